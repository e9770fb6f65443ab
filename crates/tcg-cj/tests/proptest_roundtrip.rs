//! Property tests: CJ output always re-reads to the same value and is stable.
use proptest::prelude::*;
use tcg_cj::{parse_strict, to_canonical_string, Map, Value};

fn arb_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::Float),
        any::<String>().prop_map(Value::Str),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map>())),
        ]
    })
}

proptest! {
    #[test]
    fn canonical_json_reparses_to_the_same_bytes(v in arb_value()) {
        let text = to_canonical_string(&v).unwrap();
        prop_assert!(text.is_ascii());
        let back = parse_strict(text.as_bytes()).unwrap();
        prop_assert_eq!(to_canonical_string(&back).unwrap(), text);
    }

    #[test]
    fn float_repr_round_trips_to_the_same_bits(f in any::<f64>().prop_filter("finite", |f| f.is_finite())) {
        let text = to_canonical_string(&Value::Float(f)).unwrap();
        let back: f64 = text.parse().unwrap();
        prop_assert_eq!(back.to_bits(), f.to_bits());
    }
}

proptest! {
    /// Decimal powers and short mantissas: where the shortest digits round up past a power of ten.
    #[test]
    fn short_decimal_floats_round_trip(m in 1u32..100, e in -320i32..308) {
        let f: f64 = format!("{m}e{e}").parse().unwrap();
        prop_assume!(f.is_finite() && f != 0.0);
        let text = to_canonical_string(&Value::Float(f)).unwrap();
        let back: f64 = text.parse().unwrap();
        prop_assert_eq!(back.to_bits(), f.to_bits());
    }
}

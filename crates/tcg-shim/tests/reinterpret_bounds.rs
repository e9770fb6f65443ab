//! Property: `_reinterpret_tensor` accepts a view exactly when every element
//! it reaches lies inside the storage, and the view's last element is then
//! inside the storage's bytes.

mod common;

use common::*;
use proptest::prelude::*;
use tcg_shim::*;

fn dtypes() -> impl Strategy<Value = i32> {
    prop::sample::select(vec![
        aoti_torch_dtype_uint8(),
        aoti_torch_dtype_bfloat16(),
        aoti_torch_dtype_float32(),
        aoti_torch_dtype_complex128(),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_view_is_accepted_iff_it_lies_inside_the_storage(
        dtype in dtypes(),
        storage_elems in 0i64..48,
        shape in prop::collection::vec((0i64..5, 0i64..9), 0..4),
        offset in 0i64..64,
    ) {
        let base = empty(&[storage_elems], &[1], dtype, 0, -1).unwrap();
        let item = aoti_torch_dtype_element_size(dtype) as i64;
        let sizes: Vec<i64> = shape.iter().map(|s| s.0).collect();
        let strides: Vec<i64> = shape.iter().map(|s| s.1).collect();
        let numel: i64 = sizes.iter().product();
        let last = offset + sizes.iter().zip(&strides).map(|(n, s)| (n - 1) * s).sum::<i64>();
        let inside = numel == 0 || last < storage_elems;
        match reinterpret(base, &sizes, &strides, offset) {
            Ok(v) => {
                prop_assert!(inside, "accepted a view reaching element {last} of {storage_elems}");
                prop_assert_eq!(get_i64(aoti_torch_get_numel, v), numel);
                if numel > 0 {
                    let end = data_ptr(base) as usize + (storage_elems * item) as usize;
                    let last_byte = data_ptr(v) as usize
                        + (sizes.iter().zip(&strides).map(|(n, s)| (n - 1) * s).sum::<i64>() * item + item) as usize;
                    prop_assert!(last_byte <= end);
                }
                delete(v);
            }
            Err(e) => {
                prop_assert!(!inside, "refused an inside view: {}", e);
                prop_assert_eq!(e.code(), "shim.view_out_of_bounds");
            }
        }
        delete(base);
    }
}

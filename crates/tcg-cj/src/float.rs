//! Python `repr(float)` for finite binary64 values (SPEC-v1 §2.3).

/// Split `{:e}`-style text into (negative, digits, decimal exponent).
fn split_sci(sci: &str) -> (bool, String, i32) {
    let (negative, body) = match sci.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, sci),
    };
    let (mantissa, exp) = body
        .split_once('e')
        .expect("LowerExp always writes an exponent");
    let exp: i32 = exp.parse().expect("LowerExp writes a decimal exponent");
    (
        negative,
        mantissa.chars().filter(|c| *c != '.').collect(),
        exp,
    )
}

/// The shortest round-tripping digits of `x`, choosing the one nearest the
/// exact binary value and, on an exact tie, the one with an even last digit
/// (what Python's repr does). Rust's shortest mode finds the right length but
/// rounds ties up, so the candidate of that length is recomputed from the
/// exact decimal expansion (at most 767 significant digits for a binary64).
fn shortest_digits(x: f64) -> (bool, String, i32) {
    let (negative, digits, exp) = split_sci(&format!("{x:e}"));
    let n = digits.len();
    // The exact expansion may sit one decade lower than the shortest digits
    // when those rounded up past a power of ten (1e283 is 9.99…e282 exactly);
    // the candidate is built from the exact digits at their own exponent.
    let (_, exact, exact_exp) = split_sci(&format!("{:.800e}", x));
    let (head, rest) = exact.split_at(n);
    let rest = rest.trim_end_matches('0');
    let round_up = match rest.as_bytes().first() {
        None => false,
        Some(b'5') if rest.len() == 1 => (head.as_bytes()[n - 1] - b'0') % 2 == 1,
        Some(d) => *d >= b'5',
    };
    let (candidate, candidate_exp) = if round_up {
        let mut bytes = head.as_bytes().to_vec();
        let mut i = n;
        loop {
            if i == 0 {
                bytes.insert(0, b'1');
                bytes.truncate(n);
                break (bytes, exact_exp + 1);
            }
            i -= 1;
            if bytes[i] == b'9' {
                bytes[i] = b'0';
            } else {
                bytes[i] += 1;
                break (bytes, exact_exp);
            }
        }
    } else {
        (head.as_bytes().to_vec(), exact_exp)
    };
    let candidate = String::from_utf8(candidate).expect("ascii digits");
    let text = format!(
        "{}{}.{}e{}",
        if negative { "-" } else { "" },
        &candidate[..1],
        &candidate[1..],
        candidate_exp
    );
    if text.parse::<f64>().map(f64::to_bits) == Ok(x.to_bits()) {
        let trimmed = candidate.trim_end_matches('0');
        let trimmed = if trimmed.is_empty() { "0" } else { trimmed };
        (negative, trimmed.to_string(), candidate_exp)
    } else {
        (negative, digits, exp)
    }
}

/// Format a finite float exactly as Python's `repr`.
///
/// Rust's `{:e}` yields the shortest digit string that round-trips, choosing
/// the nearest when several do; that is the digit string Python's repr uses.
/// Only the layout differs, so the digits and exponent are re-laid here.
pub(crate) fn python_repr(x: f64) -> String {
    debug_assert!(x.is_finite());
    let (negative, digits, exp) = shortest_digits(x);
    let n = digits.len() as i32;
    let mut out = String::with_capacity(digits.len() + 8);
    if negative {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', (int_len - n) as usize));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len as usize]);
                out.push('.');
                out.push_str(&digits[int_len as usize..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        let magnitude = exp.unsigned_abs();
        if magnitude < 10 {
            out.push('0');
        }
        out.push_str(&magnitude.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::python_repr;

    #[test]
    fn float_table_of_the_spec() {
        let table: &[(f64, &str)] = &[
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (9007199254740993.0, "9007199254740992.0"),
            (1e22, "1e+22"),
            (9.223372036854776e18, "9.223372036854776e+18"),
            (1.5, "1.5"),
            (100.0, "100.0"),
            (1.2345e16, "1.2345e+16"),
            (1.5e300, "1.5e+300"),
            (5e-324, "5e-324"),
            (-2.5e-7, "-2.5e-07"),
            (123456.789, "123456.789"),
            (f64::MAX, "1.7976931348623157e+308"),
            (562949953421312.2, "562949953421312.2"),
            (-562949953421312.2, "-562949953421312.2"),
            (0.3, "0.3"),
            (f64::from_bits(1), "5e-324"),
            (1e283, "1e+283"),
            (f64::from_bits(0x44b5_2d02_c7e1_4af6), "1e+23"),
            (1e23, "1e+23"),
            (0.1 + 0.2, "0.30000000000000004"),
        ];
        for (x, want) in table {
            assert_eq!(python_repr(*x), *want, "{x:e}");
        }
    }
}

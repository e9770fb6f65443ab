//! What the wrapper source says about each input, for artifacts whose metadata
//! carries no call ingress (SPEC-v1 §3.9 makes the ingress optional).
//!
//! AOTInductor emits one `check_input_<i>` function per input, run only when
//! `AOTI_RUNTIME_CHECK_INPUTS` is set: the expected dtype, each static size,
//! the bounds of each symbolic size and each static stride. This module reads
//! those facts from the text so the caller can check inputs *before* the call,
//! whatever the environment. The scan recognises only the generated forms
//! below; anything else in a condition is ignored, and a function without a
//! dtype is a refusal (`run.native_unsupported`).
//!
//! ```text
//! int32_t NAME_expected_dtype = aoti_torch_dtype_DTYPE();
//! if (D != NAME_size[K])          static size
//! if (NAME_size[K] < L)           lower bound
//! if (NAME_size[K] > U)           upper bound
//! if (S != NAME_stride[K])        static stride (evidence of rank)
//! ```
//!
//! The rank is one more than the largest dimension index any check names.
//! Inputs are C-contiguous, so the last dimension always has the static stride
//! 1 and is therefore named.

use tcg_core::{Code, Error, Result};

/// One dimension of an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Static(i64),
    /// A symbolic size with optional inclusive bounds.
    Range(Option<i64>, Option<i64>),
}

/// What the wrapper checks for one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputFact {
    /// Inductor's dtype name (`float32`).
    pub dtype: String,
    /// One entry per dimension.
    pub dims: Vec<Dim>,
    /// One entry per dimension: the static stride (in elements) the wrapper
    /// checks, `None` where it checks none (a symbolic stride).
    pub strides: Vec<Option<i64>>,
}

impl InputFact {
    /// Why a C-contiguous input of `shape` is not laid out as the graph was
    /// compiled to read it (a static stride other than the row-major one on a
    /// dimension longer than 1), or `None` when it is. A graph minted from a
    /// non-contiguous example input (a channels-last image) reads its input
    /// with that example's strides; given row-major memory it would compute
    /// from misplaced elements.
    pub fn layout_mismatch(&self, shape: &[i64]) -> Option<String> {
        let want = crate::torch::contiguous_strides(shape);
        let off = (0..shape.len().min(self.strides.len()))
            .any(|k| shape[k] > 1 && self.strides[k].is_some_and(|s| s != want[k]));
        if !off {
            return None;
        }
        let show = |v: Option<i64>| v.map_or_else(|| "?".to_owned(), |s| s.to_string());
        let compiled: Vec<String> = self.strides.iter().map(|&s| show(s)).collect();
        Some(format!(
            "the graph was compiled to read it with strides [{}] (its exported example's layout), \
             a C-contiguous input of shape {shape:?} has strides {want:?}",
            compiled.join(", ")
        ))
    }
}

fn unsupported(message: String) -> Error {
    Error::new(Code::RunNativeUnsupported, message)
}

/// `NAME_size[K]` or `NAME_stride[K]`: which of the two, and `K`.
fn indexed(token: &str) -> Option<(&'static str, usize)> {
    let token = token.strip_suffix(']')?;
    let (head, index) = token.rsplit_once('[')?;
    let index: usize = index.parse().ok()?;
    if index > 64 {
        return None;
    }
    if head.ends_with("_size") {
        Some(("size", index))
    } else if head.ends_with("_stride") {
        Some(("stride", index))
    } else {
        None
    }
}

fn integer(token: &str) -> Option<i64> {
    token.strip_suffix('L').unwrap_or(token).parse().ok()
}

fn parse_function(index: usize, body: &str) -> Result<InputFact> {
    const DTYPE: &str = "_expected_dtype = aoti_torch_dtype_";
    let dtype = body
        .find(DTYPE)
        .map(|at| &body[at + DTYPE.len()..])
        .and_then(|rest| rest.split_once("()"))
        .map(|(name, _)| name)
        .filter(|name| {
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
        .ok_or_else(|| unsupported(format!("the wrapper's check_input_{index} states no dtype")))?;
    let mut sizes: Vec<(usize, Dim)> = Vec::new();
    let mut strides: Vec<(usize, i64)> = Vec::new();
    let mut rank = 0usize;
    for piece in body.split("if (").skip(1) {
        let Some((condition, _)) = piece.split_once(')') else {
            continue;
        };
        let tokens: Vec<&str> = condition.split_whitespace().collect();
        let [a, op, b] = tokens[..] else {
            continue;
        };
        match (indexed(a), op, indexed(b)) {
            (None, "!=", Some((kind, k))) => {
                let Some(value) = integer(a) else { continue };
                rank = rank.max(k + 1);
                if kind == "size" {
                    sizes.push((k, Dim::Static(value)));
                } else {
                    strides.push((k, value));
                }
            }
            (Some(("size", k)), "<" | ">", None) => {
                let Some(value) = integer(b) else { continue };
                rank = rank.max(k + 1);
                let (lo, hi) = if op == "<" {
                    (Some(value), None)
                } else {
                    (None, Some(value))
                };
                sizes.push((k, Dim::Range(lo, hi)));
            }
            _ => {}
        }
    }
    let mut dims = vec![Dim::Range(None, None); rank];
    for (k, dim) in sizes {
        dims[k] = match (dims[k], dim) {
            (_, Dim::Static(v)) => Dim::Static(v),
            (Dim::Static(v), _) => Dim::Static(v),
            (Dim::Range(lo, hi), Dim::Range(lo2, hi2)) => Dim::Range(lo.or(lo2), hi.or(hi2)),
        };
    }
    let mut stride_of = vec![None; rank];
    for (k, value) in strides {
        stride_of[k].get_or_insert(value);
    }
    Ok(InputFact {
        dtype: dtype.to_owned(),
        dims,
        strides: stride_of,
    })
}

/// The start of every generated input check.
const MARKER: &str = "static void check_input_";

/// The input facts of a wrapper source, in input order; `None` when the
/// source has no `check_input_<i>` functions at all. Linear in the length of
/// the source: one pass finds every function and every boundary, and each
/// function body is parsed once, bodies never overlapping.
pub fn input_facts(wrapper: &str) -> Result<Option<Vec<InputFact>>> {
    input_facts_counted(wrapper).0
}

/// The bytes the input-check scan examines for `wrapper` (for the tests and
/// the fuzz target that hold it linear).
pub fn input_scan_work(wrapper: &str) -> u64 {
    input_facts_counted(wrapper).1
}

fn input_facts_counted(wrapper: &str) -> (Result<Option<Vec<InputFact>>>, u64) {
    let bytes = wrapper.as_bytes();
    // Each search below is one linear pass over the text.
    let mut work = 3 * bytes.len() as u64;
    // Where each function's body starts, by input index (first definition
    // wins), and where any definition starts.
    let mut bodies: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    let mut boundaries: Vec<usize> = Vec::new();
    for at in memchr::memmem::find_iter(bytes, MARKER) {
        boundaries.push(at);
        let digits_at = at + MARKER.len();
        let digits = bytes[digits_at..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        work += digits as u64 + 1;
        let canonical = digits > 0 && (digits == 1 || bytes[digits_at] != b'0');
        if !canonical || bytes.get(digits_at + digits) != Some(&b'(') {
            continue;
        }
        let Ok(index) = wrapper[digits_at..digits_at + digits].parse::<usize>() else {
            continue;
        };
        bodies.entry(index).or_insert(digits_at + digits + 1);
    }
    // The function ends where the next top-level definition begins.
    for m in ["\nAOTI_NOINLINE", "\nstatic "] {
        boundaries.extend(memchr::memmem::find_iter(bytes, m));
    }
    boundaries.sort_unstable();
    let mut facts = Vec::new();
    while let Some(&start) = bodies.get(&facts.len()) {
        let next = boundaries.partition_point(|&b| b < start);
        let end = boundaries.get(next).copied().unwrap_or(bytes.len());
        work += (end - start) as u64 * 4;
        match parse_function(facts.len(), &wrapper[start..end]) {
            Ok(f) => facts.push(f),
            Err(e) => return (Err(e), work),
        }
    }
    (Ok((!facts.is_empty()).then_some(facts)), work)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Check functions of the shape AOTInductor writes (static dims, a
    /// symbolic range, strides): also a seed of the `input_checks` fuzz target.
    const STATIC: &str = include_str!("../../../fuzz/seeds/input_checks/static.cpp");

    #[test]
    fn static_and_symbolic_dims_and_the_rank_are_read_from_the_checks() {
        let facts = input_facts(STATIC).unwrap().unwrap();
        assert_eq!(
            facts,
            vec![
                InputFact {
                    dtype: "float32".into(),
                    dims: vec![Dim::Static(4), Dim::Static(16)],
                    strides: vec![Some(16), Some(1)],
                },
                InputFact {
                    dtype: "int64".into(),
                    dims: vec![
                        Dim::Range(Some(2), Some(16)),
                        Dim::Static(32),
                        Dim::Range(None, None)
                    ],
                    strides: vec![None, None, Some(1)],
                },
            ]
        );
    }

    #[test]
    fn the_scan_is_linear_in_the_number_of_functions() {
        // Many definitions without any boundary between them: each body ends
        // at the next definition, so the work stays proportional to the text.
        let one = "static void check_input_0( int32_t a_expected_dtype = aoti_torch_dtype_bool(); if (1 != a_stride[0]) {} ";
        let text = |n: usize| {
            (0..n)
                .map(|i| one.replace("_0(", &format!("_{i}(")))
                .collect::<String>()
        };
        let (small, big) = (text(2000), text(4000));
        let facts = input_facts(&big).unwrap().unwrap();
        assert_eq!(facts.len(), 4000);
        let (w1, w2) = (input_scan_work(&small), input_scan_work(&big));
        assert!(w2 <= w1 * 2 + w1 / 10, "work {w1} -> {w2}");
        assert!(
            w2 <= 8 * big.len() as u64,
            "work {w2} for {} bytes",
            big.len()
        );
    }

    #[test]
    fn a_channels_last_input_is_a_layout_a_row_major_buffer_does_not_have() {
        // What AOTInductor checks for a [2, 8, 16, 16] input exported channels-last.
        let text = "static void check_input_0(\n) {\n int32_t x_expected_dtype = aoti_torch_dtype_float32();\n if (2 != x_size[0]) {}\n if (8 != x_size[1]) {}\n if (16 != x_size[2]) {}\n if (16 != x_size[3]) {}\n if (2048 != x_stride[0]) {}\n if (1 != x_stride[1]) {}\n if (128 != x_stride[2]) {}\n if (8 != x_stride[3]) {}\n}\n";
        let fact = &input_facts(text).unwrap().unwrap()[0];
        assert_eq!(fact.strides, vec![Some(2048), Some(1), Some(128), Some(8)]);
        let why = fact.layout_mismatch(&[2, 8, 16, 16]).unwrap();
        assert!(why.contains("[2048, 1, 128, 8]"), "{why}");
        // Row-major checks, or strides on dimensions of size 1 (never
        // stepped), or strides the wrapper does not state, fit any buffer.
        let (facts, _) = input_facts_counted(STATIC);
        let facts = facts.unwrap().unwrap();
        assert_eq!(facts[0].layout_mismatch(&[4, 16]), None);
        assert_eq!(facts[1].layout_mismatch(&[3, 32, 5]), None);
        let one = "static void check_input_0(\n) {\n int32_t x_expected_dtype = aoti_torch_dtype_float32();\n if (7 != x_stride[0]) {}\n if (1 != x_stride[1]) {}\n}\n";
        let fact = &input_facts(one).unwrap().unwrap()[0];
        assert_eq!(fact.layout_mismatch(&[1, 5]), None);
        assert!(fact.layout_mismatch(&[2, 5]).is_some());
    }

    #[test]
    fn a_wrapper_without_checks_has_no_facts() {
        assert_eq!(input_facts("int main() {}").unwrap(), None);
    }

    #[test]
    fn a_check_without_a_dtype_is_refused() {
        let text = "static void check_input_0(\n) {\n if (4 != x_size[0]) {}\n}\n";
        let err = input_facts(text).unwrap_err();
        assert_eq!(err.code(), Code::RunNativeUnsupported);
    }

    #[test]
    fn absurd_indices_and_non_numeric_bounds_are_ignored() {
        let text = "static void check_input_0(\n) {\n int32_t a_expected_dtype = aoti_torch_dtype_bool();\n if (4 != a_size[99999]) {}\n if (a_size[0] > s0) {}\n}\n";
        let facts = input_facts(text).unwrap().unwrap();
        assert_eq!(facts[0].dims, vec![]);
    }
}

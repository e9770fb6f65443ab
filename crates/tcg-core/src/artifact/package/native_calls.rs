//! Calls in an AOTInductor wrapper that the torch-free runner cannot make
//! (project addition; docs/run.md, "What load_native refuses").
//!
//! The generated wrapper runs most operators through kernels it carries or
//! through libtorch's C shim (`aoti_torch_cpu_*`, `aoti_torch_cuda_*`). Two
//! forms need more than libtorch's shared libraries:
//!
//! - `aoti_torch_proxy_executor_call_function(proxy_executor, INDEX, …)`:
//!   an operator without a C shim (a custom op registered from Python with
//!   `torch.library`, a higher-order op). torch's package loader runs it
//!   through a proxy executor that looks the operator up in the dispatcher,
//!   where only the process that registered it finds it; the native runner
//!   creates its container without a proxy executor. `INDEX` names the
//!   operator in the entry's extern-kernel table (`*.json` beside the
//!   wrapper: `{"nodes": [{"node": {"target": "ns::op", …}}, …]}`).
//! - `aoti_torch_call_dispatcher("ns::op", …)`: a boxed dispatcher call.
//!   Operators of the `aten` namespace are in libtorch and are left alone;
//!   any other namespace is registered by a library the native process has
//!   not loaded.
//!
//! The scan is one pass per form over the text (`memchr::memmem`), with
//! bounded work at each hit, so its time is linear in the wrapper's size
//! ([`native_calls_scan_work`] counts it for the tests and the fuzz target).

use std::collections::BTreeMap;

use tcg_cj::{Map, Value};

/// The proxy-executor call of the generated code.
pub const PROXY_EXECUTOR_CALL: &str = "aoti_torch_proxy_executor_call_function";
/// The boxed dispatcher call of the generated code.
pub const DISPATCHER_CALL: &str = "aoti_torch_call_dispatcher";
/// Most bytes looked at past the `(` of one call for its first arguments.
const ARGUMENT_WINDOW: usize = 512;
/// Most extern-kernel nodes read from the table.
const MAX_EXTERN_NODES: usize = 1 << 16;

/// One kind of call the native path cannot make, with how often the wrapper
/// makes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct UnsupportedCall {
    /// The C function the wrapper calls ([`PROXY_EXECUTOR_CALL`] or
    /// [`DISPATCHER_CALL`]).
    pub call: String,
    /// The operator, for example `mylib::scale`; `extern kernel N` when the
    /// extern-kernel table does not name the proxy call's index.
    pub target: String,
    /// The number of call sites.
    pub count: u64,
}

impl UnsupportedCall {
    /// The record object `{call, count, target}`.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("call".into(), Value::Str(self.call.clone()));
        m.insert("count".into(), Value::Int(self.count as i64));
        m.insert("target".into(), Value::Str(self.target.clone()));
        Value::Object(m)
    }

    /// `target ×count (call)`, for messages.
    pub fn describe(&self) -> String {
        format!("{} ×{} ({})", self.target, self.count, self.call)
    }
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn skip_ws(s: &[u8], mut i: usize, end: usize) -> usize {
    while i < end && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The position just past `name ws (` when the hit at `at` is a call, not
/// part of a longer identifier.
fn call_open(s: &[u8], at: usize, name: &str) -> Option<usize> {
    if at > 0 && is_ident(s[at - 1]) {
        return None;
    }
    let after = at + name.len();
    let end = s.len().min(after + ARGUMENT_WINDOW);
    let i = skip_ws(s, after, end);
    (i < end && s[i] == b'(').then_some(i + 1)
}

/// The extern-kernel index: the second argument of a proxy call, `DIGITS`.
fn proxy_index(s: &[u8], open: usize) -> Option<u64> {
    let end = s.len().min(open + ARGUMENT_WINDOW);
    let comma = memchr::memchr(b',', &s[open..end])? + open;
    let mut i = skip_ws(s, comma + 1, end);
    let start = i;
    while i < end && s[i].is_ascii_digit() && i - start < 19 {
        i += 1;
    }
    if i == start {
        return None;
    }
    std::str::from_utf8(&s[start..i]).ok()?.parse().ok()
}

/// The operator of a dispatcher call: its first argument, a quoted string.
fn dispatcher_op(s: &[u8], open: usize) -> Option<String> {
    let end = s.len().min(open + ARGUMENT_WINDOW);
    let i = skip_ws(s, open, end);
    if i >= end || s[i] != b'"' {
        return None;
    }
    let close = memchr::memchr(b'"', &s[i + 1..end])? + i + 1;
    let op = std::str::from_utf8(&s[i + 1..close]).ok()?;
    (!op.is_empty() && !op.contains('\n')).then(|| op.to_owned())
}

/// The operator names of an extern-kernel table (`nodes[i].node.target`), by
/// index; an unreadable table names nothing.
pub fn extern_kernel_targets(table: &[u8]) -> Vec<Option<String>> {
    let Ok(Value::Object(top)) = tcg_cj::parse_strict(table) else {
        return Vec::new();
    };
    let Some(Value::Array(nodes)) = top.get("nodes") else {
        return Vec::new();
    };
    nodes
        .iter()
        .take(MAX_EXTERN_NODES)
        .map(|n| {
            n.as_object()
                .and_then(|n| n.get("node"))
                .and_then(Value::as_object)
                .and_then(|n| n.get("target"))
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
        })
        .collect()
}

fn scan_counted(wrapper: &str, targets: &[Option<String>]) -> (Vec<UnsupportedCall>, u64) {
    let s = wrapper.as_bytes();
    let mut found: BTreeMap<(String, String), u64> = BTreeMap::new();
    let mut work = 0u64;
    for name in [PROXY_EXECUTOR_CALL, DISPATCHER_CALL] {
        work += s.len() as u64;
        for at in memchr::memmem::find_iter(s, name.as_bytes()) {
            work += ARGUMENT_WINDOW as u64;
            let Some(open) = call_open(s, at, name) else {
                continue;
            };
            let target = if name == PROXY_EXECUTOR_CALL {
                let index = proxy_index(s, open);
                match index.and_then(|i| targets.get(usize::try_from(i).ok()?).cloned().flatten()) {
                    Some(t) => t,
                    None => match index {
                        Some(i) => format!("extern kernel {i}"),
                        None => "extern kernel ?".to_owned(),
                    },
                }
            } else {
                match dispatcher_op(s, open) {
                    // ATen operators are libtorch's own.
                    Some(op) if op.starts_with("aten::") => continue,
                    Some(op) => op,
                    None => "operator ?".to_owned(),
                }
            };
            *found.entry((name.to_owned(), target)).or_default() += 1;
        }
    }
    let calls = found
        .into_iter()
        .map(|((call, target), count)| UnsupportedCall {
            call,
            target,
            count,
        })
        .collect();
    (calls, work)
}

/// The calls of `wrapper` the native path cannot make, one row per (call,
/// operator), sorted; `extern_table` is the entry's extern-kernel table when
/// there is one (it names the proxy calls' operators).
pub fn scan_native_calls(wrapper: &str, extern_table: Option<&[u8]>) -> Vec<UnsupportedCall> {
    let targets = extern_table.map(extern_kernel_targets).unwrap_or_default();
    scan_counted(wrapper, &targets).0
}

/// The bytes [`scan_native_calls`] examines (its work), for the linearity
/// tests and the fuzz target: at most 2 per byte plus
/// [`ARGUMENT_WINDOW`] per hit.
pub fn native_calls_scan_work(wrapper: &str) -> u64 {
    scan_counted(wrapper, &[]).1
}

/// The extern-kernel table member of an entry whose wrapper is `wrapper`
/// (`X.wrapper.cpp` → `X.wrapper.json`, or `X.json`), when `names` has it.
pub fn extern_table_member<'a>(wrapper: &str, names: &'a [String]) -> Option<&'a String> {
    let stem = wrapper.strip_suffix(".cpp")?;
    let wanted = [
        format!("{stem}.json"),
        format!("{}.json", stem.strip_suffix(".wrapper").unwrap_or(stem)),
    ];
    names.iter().find(|n| wanted.contains(n))
}

/// The record value of a scan: an array of `{call, count, target}`.
pub fn calls_value(calls: &[UnsupportedCall]) -> Value {
    Value::Array(calls.iter().map(UnsupportedCall::to_value).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &[u8] = br#"{"nodes": [{"name": "buf1", "node": {"target": "tcgprobe::twice", "inputs": [], "outputs": [], "metadata": {"torch_library_custom_op": "1"}, "is_hop_single_tensor_return": null, "name": null}}, {"name": "buf3", "node": {"target": "mylib::other"}}]}"#;

    // The form torch 2.15's cpp_wrapper_cpu emits (from a real compile of a
    // torch.library custom op without a C shim).
    const PROXY: &str = "    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_proxy_executor_call_function(proxy_executor, 0, 0, std::array<int64_t, 0>{}.data(), 2, std::array<AtenTensorHandle, 2>{buf0, buf1}.data()));\n";

    fn call(call: &str, target: &str, count: u64) -> UnsupportedCall {
        UnsupportedCall {
            call: call.into(),
            target: target.into(),
            count,
        }
    }

    #[test]
    fn a_proxy_call_is_named_from_the_extern_kernel_table() {
        let text = format!(
            "void run() {{\n{PROXY}{}}}\n",
            PROXY.replace(", 0, 0,", ", 1, 0,")
        );
        let text = format!("{text}{PROXY}");
        assert_eq!(
            scan_native_calls(&text, Some(TABLE)),
            vec![
                call(PROXY_EXECUTOR_CALL, "mylib::other", 1),
                call(PROXY_EXECUTOR_CALL, "tcgprobe::twice", 2),
            ]
        );
    }

    #[test]
    fn without_a_table_the_index_names_the_call() {
        assert_eq!(
            scan_native_calls(PROXY, None),
            vec![call(PROXY_EXECUTOR_CALL, "extern kernel 0", 1)]
        );
        // An index past the table, or a table that is not JSON.
        let far = PROXY.replace(", 0, 0,", ", 7, 0,");
        assert_eq!(
            scan_native_calls(&far, Some(TABLE)),
            vec![call(PROXY_EXECUTOR_CALL, "extern kernel 7", 1)]
        );
        assert_eq!(
            scan_native_calls(PROXY, Some(b"{not json")),
            vec![call(PROXY_EXECUTOR_CALL, "extern kernel 0", 1)]
        );
        let odd = "aoti_torch_proxy_executor_call_function(proxy_executor);";
        assert_eq!(
            scan_native_calls(odd, Some(TABLE)),
            vec![call(PROXY_EXECUTOR_CALL, "extern kernel ?", 1)]
        );
    }

    #[test]
    fn dispatcher_calls_outside_aten_are_unsupported() {
        let text = concat!(
            "aoti_torch_call_dispatcher(\"aten::add\", \"Tensor\", vars.data());\n",
            "aoti_torch_call_dispatcher( \"mylib::scale\", \"\", vars.data());\n",
            "aoti_torch_call_dispatcher(\"mylib::scale\", \"\", vars.data());\n",
            "aoti_torch_call_dispatcher(name, \"\", vars.data());\n",
        );
        assert_eq!(
            scan_native_calls(text, None),
            vec![
                call(DISPATCHER_CALL, "mylib::scale", 2),
                call(DISPATCHER_CALL, "operator ?", 1),
            ]
        );
    }

    #[test]
    fn names_that_are_not_calls_are_ignored() {
        let text = concat!(
            "// aoti_torch_proxy_executor_call_function is declared in shim.h\n",
            "my_aoti_torch_proxy_executor_call_function(x, 0);\n",
            "aoti_torch_proxy_executor_call_function_v2(x, 0);\n",
            "auto f = &aoti_torch_call_dispatcher;\n",
            "AOTIProxyExecutorHandle proxy_executor_handle) {\n",
        );
        assert!(scan_native_calls(text, Some(TABLE)).is_empty());
        // The real wrapper of an aten-only graph makes none of these calls.
        let plain = crate::artifact::package::wrapper::synthetic_wrapper(false, &[]);
        assert!(scan_native_calls(&plain, None).is_empty());
    }

    #[test]
    fn the_table_member_sits_beside_the_wrapper() {
        let names: Vec<String> = [
            "model/data/aotinductor/g/abc.wrapper.cpp",
            "model/data/aotinductor/g/abc.wrapper.json",
            "model/data/aotinductor/g/abc.wrapper_metadata.json",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            extern_table_member(&names[0], &names),
            Some(&names[1]),
            "torch 2.15's name"
        );
        let older: Vec<String> = [
            "model/data/aotinductor/g/abc.wrapper.cpp",
            "model/data/aotinductor/g/abc.json",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(extern_table_member(&older[0], &older), Some(&older[1]));
        assert_eq!(extern_table_member(&older[0], &older[..1]), None);
    }

    #[test]
    fn the_record_value_is_sorted_rows_of_three_members() {
        let calls = scan_native_calls(PROXY, Some(TABLE));
        assert_eq!(
            tcg_cj::to_canonical(&calls_value(&calls)).unwrap(),
            br#"[{"call":"aoti_torch_proxy_executor_call_function","count":1,"target":"tcgprobe::twice"}]"#
        );
    }

    #[test]
    fn the_scan_is_linear_in_the_text() {
        // Hits every few bytes (each with an unterminated argument list) and
        // long runs without a hit both cost a bounded amount per byte.
        for unit in [
            "aoti_torch_proxy_executor_call_function(",
            "aoti_torch_call_dispatcher(\"",
            "aoti_torch_proxy_executor_call_function                ",
            "x",
        ] {
            for n in [1_000usize, 2_000] {
                let text = unit.repeat(n);
                let work = native_calls_scan_work(&text);
                assert!(
                    work <= 2 * text.len() as u64
                        + ARGUMENT_WINDOW as u64 * (text.len() / 26 + 1) as u64,
                    "{unit:?} × {n}: work {work}"
                );
                assert!(
                    work <= 24 * text.len() as u64,
                    "{unit:?} × {n}: work {work}"
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        // Arbitrary text with call fragments spliced in: the scan never
        // panics, its work stays under 24 per byte, and every counted call
        // site is a real occurrence of its function's name.
        #[test]
        fn arbitrary_text_scans_in_bounded_work(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::prelude::Just(PROXY.to_owned()),
                    proptest::prelude::Just("aoti_torch_call_dispatcher(\"x::y\"".to_owned()),
                    proptest::prelude::Just("aoti_torch_proxy_executor_call_function(".to_owned()),
                    "[ -~\n]{0,40}",
                    proptest::prelude::any::<String>(),
                ],
                0..40,
            ),
            table in proptest::prelude::any::<Vec<u8>>(),
        ) {
            let text: String = parts.concat();
            let calls = scan_native_calls(&text, Some(&table));
            let work = native_calls_scan_work(&text);
            proptest::prop_assert!(work <= 24 * text.len() as u64 + 2 * ARGUMENT_WINDOW as u64);
            for c in &calls {
                let hits = text.matches(c.call.as_str()).count() as u64;
                proptest::prop_assert!(c.count >= 1 && c.count <= hits);
            }
        }
    }
}

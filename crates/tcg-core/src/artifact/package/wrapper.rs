//! The constant table of an AOTInductor `*.wrapper.cpp` (SPEC-v1 §8.3): a
//! hand-written scanner for the constructor call and the four assignment
//! forms. Every refusal is `artifact.wrapper_parse`.

use std::collections::{BTreeMap, BTreeSet};

use tcg_cj::is_w;

use crate::artifact::metadata::{ConstantRow, ConstantSource};
use crate::error::{Code, Error, Result};

/// One row of the wrapper's constant table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrapperConstant {
    /// The table index.
    pub index: u64,
    /// `name` (the mangled buffer name).
    pub name: String,
    /// `original_fqn`, when assigned.
    pub original_fqn: Option<String>,
    /// `data_size` in bytes (AOTI rounds it up to a multiple of 64).
    pub data_size: u64,
    /// `from_folded`.
    pub from_folded: bool,
    /// The `ConstantType` identifier, for example `Parameter`.
    pub constant_type: String,
    /// The dtype identifier after `cached_torch_dtype_`, for example `float32`.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
}

impl WrapperConstant {
    /// `original_fqn` when non-empty, else `name`.
    pub fn fqn(&self) -> &str {
        match &self.original_fqn {
            Some(f) if !f.is_empty() => f,
            _ => &self.name,
        }
    }

    /// `Parameter`/`Buffer` → state_dict, `FoldedConstant` → computed, any
    /// other type → literal.
    pub fn source(&self) -> ConstantSource {
        match self.constant_type.as_str() {
            "Parameter" | "Buffer" => ConstantSource::StateDict,
            "FoldedConstant" => ConstantSource::Computed,
            _ => ConstantSource::Literal,
        }
    }

    /// The manifest row `{fqn, source, dtype, shape}`.
    pub fn row(&self) -> ConstantRow {
        ConstantRow {
            fqn: self.fqn().to_owned(),
            source: self.source(),
            dtype: self.dtype.clone(),
            shape: self.shape.clone(),
        }
    }
}

/// The parsed wrapper: the constructor's facts and the constant table in
/// index order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrapperTable {
    /// The declared constant count N (constructor argument 2).
    pub declared_count: u64,
    /// The constructor's last argument.
    pub load_constants_from_blob: bool,
    /// Rows 0..N−1.
    pub constants: Vec<WrapperConstant>,
}

impl WrapperTable {
    /// The manifest rows in index order.
    pub fn rows(&self) -> Vec<ConstantRow> {
        self.constants.iter().map(WrapperConstant::row).collect()
    }
}

fn fail(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactWrapperParse,
        format!("wrapper constant table: {what}"),
    )
}

const PREFIX: &str = "constants_info_[";

/// Where the next occurrence of one byte lies, remembered across queries: the
/// scan asks for positions that only move forward, so each byte of the text
/// is searched at most once per form and the scan stays linear (a closing
/// quote or brace that never comes is not searched for again and again).
struct NextByte {
    byte: u8,
    /// The last query position.
    from: usize,
    /// The answer for `from`: the first occurrence at or after it.
    at: Option<usize>,
    /// Bytes searched so far.
    work: u64,
}

impl NextByte {
    fn new(byte: u8) -> Self {
        NextByte {
            byte,
            from: usize::MAX,
            at: None,
            work: 0,
        }
    }

    /// The first occurrence of the byte at or after `from` in `text`.
    fn find(&mut self, text: &[u8], from: usize) -> Option<usize> {
        let cached =
            self.from != usize::MAX && from >= self.from && self.at.is_none_or(|at| from <= at);
        if !cached {
            let hit = memchr::memchr(self.byte, &text[from..]);
            self.work += hit.map_or(text.len() - from, |h| h + 1) as u64;
            self.from = from;
            self.at = hit.map(|h| from + h);
        }
        self.at
    }
}

struct Cur<'a, 'n> {
    s: &'a str,
    i: usize,
    quote: &'n mut NextByte,
    brace: &'n mut NextByte,
}

impl<'a> Cur<'a, '_> {
    fn lit(&mut self, t: &str) -> bool {
        if self.s[self.i..].starts_with(t) {
            self.i += t.len();
            true
        } else {
            false
        }
    }
    fn ws(&mut self) {
        while let Some(c) = self.s[self.i..].chars().next() {
            if !is_w(c) {
                break;
            }
            self.i += c.len_utf8();
        }
    }
    fn run(&mut self, pred: impl Fn(u8) -> bool) -> Option<&'a str> {
        let start = self.i;
        let b = self.s.as_bytes();
        while self.i < b.len() && pred(b[self.i]) {
            self.i += 1;
        }
        (self.i > start).then(|| &self.s[start..self.i])
    }
    fn digits(&mut self) -> Option<&'a str> {
        self.run(|c| c.is_ascii_digit())
    }
    fn ident(&mut self) -> Option<&'a str> {
        self.run(|c| c.is_ascii_alphanumeric() || c == b'_')
    }
    /// `constants_info_[DIGITS].` — returns the index text.
    fn head(&mut self) -> Option<&'a str> {
        if !self.lit(PREFIX) {
            return None;
        }
        let idx = self.digits()?;
        (self.lit("]") && self.lit(".")).then_some(idx)
    }
    /// `ws = ws`
    fn eq(&mut self) -> bool {
        self.ws();
        let ok = self.lit("=");
        self.ws();
        ok
    }
    /// `ws ;`
    fn end(&mut self) -> bool {
        self.ws();
        self.lit(";")
    }
}

/// A value of the FIELD form.
#[derive(Debug, Clone)]
enum FieldValue {
    Quoted(String),
    Digits(String),
    Bool(bool),
}

/// One match: (index text, field name, value).
type Assignment = (String, &'static str, Parsed);

#[derive(Debug, Clone)]
enum Parsed {
    Field(FieldValue),
    Ident(String),
    Shape(String),
}

const FIELDS: [&str; 4] = ["name", "data_size", "from_folded", "original_fqn"];

fn match_field(c: &mut Cur<'_, '_>) -> Option<(String, &'static str, Parsed)> {
    let idx = c.head()?.to_owned();
    let field = FIELDS.into_iter().find(|f| c.lit(f))?;
    if !c.eq() {
        return None;
    }
    let value = if c.lit("\"") {
        let open = c.i;
        let close = c.quote.find(c.s.as_bytes(), open)?;
        c.i = close + 1;
        FieldValue::Quoted(c.s[open..close].to_owned())
    } else if let Some(d) = c.digits() {
        FieldValue::Digits(d.to_owned())
    } else if c.lit("true") {
        FieldValue::Bool(true)
    } else if c.lit("false") {
        FieldValue::Bool(false)
    } else {
        return None;
    };
    c.end().then_some((idx, field, Parsed::Field(value)))
}

fn match_type(c: &mut Cur<'_, '_>) -> Option<(String, &'static str, Parsed)> {
    let idx = c.head()?.to_owned();
    if !(c.lit("type") && c.eq() && c.lit("static_cast<int32_t>")) {
        return None;
    }
    c.ws();
    if !c.lit("(") {
        return None;
    }
    c.ws();
    if !c.lit("torch::aot_inductor::ConstantType::") {
        return None;
    }
    let ident = c.ident()?.to_owned();
    c.ws();
    if !c.lit(")") {
        return None;
    }
    c.end().then_some((idx, "type", Parsed::Ident(ident)))
}

fn match_dtype(c: &mut Cur<'_, '_>) -> Option<(String, &'static str, Parsed)> {
    let idx = c.head()?.to_owned();
    if !(c.lit("dtype") && c.eq() && c.lit("cached_torch_dtype_")) {
        return None;
    }
    let ident = c.ident()?.to_owned();
    c.end().then_some((idx, "dtype", Parsed::Ident(ident)))
}

fn match_shape(c: &mut Cur<'_, '_>) -> Option<(String, &'static str, Parsed)> {
    let idx = c.head()?.to_owned();
    if !(c.lit("shape") && c.eq() && c.lit("{")) {
        return None;
    }
    let open = c.i;
    let close = c.brace.find(c.s.as_bytes(), open)?;
    c.i = close + 1;
    let inner = c.s[open..close].to_owned();
    c.end().then_some((idx, "shape", Parsed::Shape(inner)))
}

type Matcher = fn(&mut Cur<'_, '_>) -> Option<Assignment>;

/// Leftmost non-overlapping matches of one form over the whole text. Returns
/// the bytes examined: the prefix search, each attempt's cursor and the
/// closing-byte searches, each linear in the text (a failed attempt examines
/// only runs of digits, whitespace and identifiers, which cannot hold the
/// next prefix, plus a cached closing-byte search).
fn scan(text: &str, form: Matcher, out: &mut Vec<Assignment>) -> u64 {
    let finder = memchr::memmem::Finder::new(PREFIX);
    let mut quote = NextByte::new(b'"');
    let mut brace = NextByte::new(b'}');
    let mut work = 0u64;
    let mut pos = 0;
    loop {
        let Some(off) = finder.find(&text.as_bytes()[pos..]) else {
            work += (text.len() - pos) as u64;
            break;
        };
        let start = pos + off;
        work += (off + PREFIX.len()) as u64;
        let mut c = Cur {
            s: text,
            i: start,
            quote: &mut quote,
            brace: &mut brace,
        };
        let m = form(&mut c);
        let reached = c.i;
        work += (reached - start) as u64;
        match m {
            Some(m) => {
                out.push(m);
                pos = reached;
            }
            None => pos = start + 1,
        }
    }
    work + quote.work + brace.work
}

/// The constructor facts: (declared count, load_constants_from_blob).
fn parse_constructor(text: &str) -> Result<(u64, bool)> {
    const CALL: &str = "AOTInductorModelBase(";
    let start = text
        .find(CALL)
        .ok_or_else(|| fail("no AOTInductorModelBase( constructor call"))?
        + CALL.len();
    let mut depth = 1usize;
    let mut args = Vec::new();
    let mut arg_start = start;
    let mut end = None;
    for (off, ch) in text[start..].char_indices() {
        let at = start + off;
        match ch {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth == 0 {
                    args.push(&text[arg_start..at]);
                    end = Some(at);
                    break;
                }
            }
            ',' if depth == 1 => {
                args.push(&text[arg_start..at]);
                arg_start = at + 1;
            }
            _ => {}
        }
    }
    if end.is_none() {
        return Err(fail("the AOTInductorModelBase( call is not closed"));
    }
    let args: Vec<&str> = args.into_iter().map(tcg_cj::trim_w).collect();
    if args.len() < 4 {
        return Err(fail(format_args!(
            "AOTInductorModelBase( has {} arguments, expected at least 4",
            args.len()
        )));
    }
    let count = args[2];
    if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
        return Err(fail(format_args!(
            "constant count argument {count:?} is not digits"
        )));
    }
    let count: u64 = count
        .parse()
        .map_err(|_| fail(format_args!("constant count {count} is too large")))?;
    let blob = match *args.last().expect("at least 4") {
        "true" => true,
        "false" => false,
        other => {
            return Err(fail(format_args!(
                "load_constants_from_blob argument {other:?} is not true or false"
            )))
        }
    };
    Ok((count, blob))
}

fn parse_shape(inner: &str) -> std::result::Result<Vec<u64>, String> {
    let mut dims = Vec::new();
    for part in inner.split(',') {
        let part = tcg_cj::trim_w(part);
        if part.is_empty() {
            continue;
        }
        if !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("shape element {part:?} is not digits"));
        }
        dims.push(
            part.parse()
                .map_err(|_| format!("shape element {part} is too large"))?,
        );
    }
    Ok(dims)
}

/// Parse a wrapper's text (§8.3), in time linear in its length.
pub fn parse_wrapper_text(text: &str) -> Result<WrapperTable> {
    parse_counted(text).0
}

/// The bytes the wrapper scan examines for `text` (for the tests and the
/// fuzz target that hold the scan linear: it is at most a small constant
/// times the length).
pub fn wrapper_scan_work(text: &str) -> u64 {
    parse_counted(text).1
}

fn parse_counted(text: &str) -> (Result<WrapperTable>, u64) {
    let mut work = 0u64;
    let table = parse_table(text, &mut work);
    (table, work)
}

fn parse_table(text: &str, work: &mut u64) -> Result<WrapperTable> {
    let (declared_count, load_constants_from_blob) = parse_constructor(text)?;
    *work += text.len() as u64;
    let mut found = Vec::new();
    let forms: [Matcher; 4] = [match_field, match_type, match_dtype, match_shape];
    for form in forms {
        *work += scan(text, form, &mut found);
    }
    let mut by_index: BTreeMap<u64, BTreeMap<&'static str, Parsed>> = BTreeMap::new();
    for (idx, field, value) in found {
        let index: u64 = idx
            .parse()
            .map_err(|_| fail(format_args!("constant index {idx} is too large")))?;
        let fields = by_index.entry(index).or_default();
        if fields.insert(field, value).is_some() {
            return Err(fail(format_args!(
                "constants_info_[{index}].{field} is assigned twice"
            )));
        }
    }
    let have: BTreeSet<u64> = by_index.keys().copied().collect();
    let missing: Vec<u64> = (0..declared_count)
        .filter(|i| !have.contains(i))
        .take(16)
        .collect();
    let unexpected: Vec<u64> = have
        .iter()
        .copied()
        .filter(|&i| i >= declared_count)
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() {
        return Err(fail(format_args!(
            "indices do not match declared count {declared_count} (missing {missing:?}, unexpected {unexpected:?})"
        )));
    }
    let mut constants = Vec::with_capacity(by_index.len());
    for (index, mut fields) in by_index {
        let required = ["name", "data_size", "from_folded", "type", "dtype", "shape"];
        let lacking: Vec<&str> = required
            .into_iter()
            .filter(|f| !fields.contains_key(f))
            .collect();
        if !lacking.is_empty() {
            return Err(fail(format_args!(
                "constant {index}: missing required fields {lacking:?}"
            )));
        }
        let bad = |field: &str, want: &str| {
            fail(format_args!(
                "constants_info_[{index}].{field} must be {want}"
            ))
        };
        let name = match fields.remove("name") {
            Some(Parsed::Field(FieldValue::Quoted(s))) => s,
            _ => return Err(bad("name", "a quoted string")),
        };
        let original_fqn = match fields.remove("original_fqn") {
            None => None,
            Some(Parsed::Field(FieldValue::Quoted(s))) => Some(s),
            _ => return Err(bad("original_fqn", "a quoted string")),
        };
        let data_size = match fields.remove("data_size") {
            Some(Parsed::Field(FieldValue::Digits(d))) => {
                d.parse().map_err(|_| bad("data_size", "a u64"))?
            }
            _ => return Err(bad("data_size", "digits")),
        };
        let from_folded = match fields.remove("from_folded") {
            Some(Parsed::Field(FieldValue::Bool(b))) => b,
            _ => return Err(bad("from_folded", "true or false")),
        };
        let ident = |p: Option<Parsed>| match p {
            Some(Parsed::Ident(s)) => s,
            _ => unreachable!("type and dtype forms capture identifiers"),
        };
        let constant_type = ident(fields.remove("type"));
        let dtype = ident(fields.remove("dtype"));
        let shape = match fields.remove("shape") {
            Some(Parsed::Shape(s)) => {
                parse_shape(&s).map_err(|m| fail(format_args!("constant {index}: {m}")))?
            }
            _ => unreachable!("shape form captures its braces"),
        };
        constants.push(WrapperConstant {
            index,
            name,
            original_fqn,
            data_size,
            from_folded,
            constant_type,
            dtype,
            shape,
        });
    }
    Ok(WrapperTable {
        declared_count,
        load_constants_from_blob,
        constants,
    })
}

/// Parse wrapper bytes: they must be UTF-8 (§8.3).
pub fn parse_wrapper(bytes: &[u8]) -> Result<WrapperTable> {
    let text = std::str::from_utf8(bytes).map_err(|_| fail("the wrapper is not UTF-8"))?;
    parse_wrapper_text(text)
}

/// Render a wrapper text with the given constructor facts and constants, in
/// the shape torch emits (for tests, the corpus generator and benchmarks).
pub fn synthetic_wrapper(load_constants_from_blob: bool, constants: &[WrapperConstant]) -> String {
    let mut s = String::from(
        "// synthetic AOTInductor wrapper\n#include <cstdint>\nnamespace torch::aot_inductor {\n",
    );
    s.push_str(&format!(
        "AOTInductorModel::AOTInductorModel(std::shared_ptr<ConstantMap> constants_map,\n    std::optional<std::string> cubin_dir)\n    : AOTInductorModelBase(1,\n                           1,\n                           {},\n                           device_str,\n                           std::move(cubin_dir),\n                           {}) {{\n",
        constants.len(),
        load_constants_from_blob
    ));
    for c in constants {
        let i = c.index;
        let dims: Vec<String> = c.shape.iter().map(u64::to_string).collect();
        s.push_str(&format!(
            "    constants_info_[{i}].name = \"{}\";\n",
            c.name
        ));
        s.push_str(&format!(
            "    constants_info_[{i}].dtype = cached_torch_dtype_{};\n",
            c.dtype
        ));
        s.push_str(&format!("    constants_info_[{i}].offset = 0;\n"));
        s.push_str(&format!(
            "    constants_info_[{i}].data_size = {};\n",
            c.data_size
        ));
        s.push_str(&format!(
            "    constants_info_[{i}].from_folded = {};\n",
            c.from_folded
        ));
        s.push_str(&format!(
            "    constants_info_[{i}].type = static_cast<int32_t>(torch::aot_inductor::ConstantType::{});\n",
            c.constant_type
        ));
        s.push_str(&format!(
            "    constants_info_[{i}].shape = {{{}}};\n",
            dims.join(", ")
        ));
        if let Some(f) = &c.original_fqn {
            s.push_str(&format!(
                "    constants_info_[{i}].original_fqn = \"{f}\";\n"
            ));
        }
    }
    s.push_str("}\n} // namespace torch::aot_inductor\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(i: u64, ty: &str) -> WrapperConstant {
        WrapperConstant {
            index: i,
            name: format!("c_{i}"),
            original_fqn: Some(format!("m.c{i}")),
            data_size: 64,
            from_folded: false,
            constant_type: ty.into(),
            dtype: "float32".into(),
            shape: vec![4, 4],
        }
    }

    #[test]
    fn the_synthetic_wrapper_round_trips() {
        let rows = vec![
            row(0, "Parameter"),
            row(1, "FoldedConstant"),
            row(2, "TensorConstant"),
        ];
        let t = parse_wrapper_text(&synthetic_wrapper(false, &rows)).unwrap();
        assert_eq!(t.declared_count, 3);
        assert!(!t.load_constants_from_blob);
        assert_eq!(t.constants, rows);
        let sources: Vec<_> = t.rows().into_iter().map(|r| r.source).collect();
        assert_eq!(
            sources,
            [
                ConstantSource::StateDict,
                ConstantSource::Computed,
                ConstantSource::Literal
            ]
        );
    }

    #[test]
    fn whitespace_of_w_is_allowed_inside_forms() {
        let text = "AOTInductorModelBase(1, 1, 1, d, (x), false)\n constants_info_[0].name\u{3000}=\u{a0}\"n\" ;\
            constants_info_[0].data_size=0;constants_info_[0].from_folded = true ;\
            constants_info_[0].type = static_cast<int32_t> ( torch::aot_inductor::ConstantType::Buffer ) ;\
            constants_info_[0].dtype = cached_torch_dtype_int8 ;constants_info_[0].shape = { } ;";
        let t = parse_wrapper_text(text).unwrap();
        let c = &t.constants[0];
        assert_eq!((c.fqn(), c.shape.len(), c.from_folded), ("n", 0, true));
    }

    /// A wrapper whose tail is `n` unterminated assignments of the shapes
    /// that used to make the scan search to the end of the text each time.
    pub(crate) fn padded(n: usize) -> String {
        let mut s = synthetic_wrapper(false, &[row(0, "Parameter")]);
        for _ in 0..n {
            s.push_str("constants_info_[7].name = \"constants_info_[7].shape = {constants_info_[7].original_fqn = \"\n");
        }
        s
    }

    #[test]
    fn the_scan_is_linear_in_the_padding() {
        let (a, b) = (padded(20_000), padded(40_000));
        let (wa, wb) = (wrapper_scan_work(&a), wrapper_scan_work(&b));
        assert!(wb <= 2 * wa + wa / 10, "work {wa} -> {wb}");
        assert!(wb <= 24 * b.len() as u64, "work {wb} for {} bytes", b.len());
        // The padding holds no complete assignment of any form: the table
        // is the unpadded one.
        assert_eq!(
            parse_wrapper_text(&b).unwrap(),
            parse_wrapper_text(&padded(0)).unwrap()
        );
    }

    #[test]
    fn refusals_are_wrapper_parse() {
        let good = synthetic_wrapper(false, &[row(0, "Parameter")]);
        let cases = [
            good.replace("AOTInductorModelBase(", "Base("),
            good.replace("                           false) {", "false"),
            good.replace("= 64;", "= 64;\n    constants_info_[0].data_size = 64;"),
            good.replace("constants_info_[0].dtype", "constants_info_[1].dtype"),
            good.replace("constants_info_[0].dtype = cached_torch_dtype_float32;", ""),
            good.replace("= \"c_0\"", "= 7"),
            good.replace("{4, 4}", "{4, x}"),
            good.replace(
                "                           1,\n                           device_str",
                "                           x,\n                           device_str",
            ),
        ];
        for (i, case) in cases.iter().enumerate() {
            assert_eq!(
                parse_wrapper_text(case).unwrap_err().code(),
                Code::ArtifactWrapperParse,
                "case {i}"
            );
        }
        assert_eq!(
            parse_wrapper(b"\xff").unwrap_err().code(),
            Code::ArtifactWrapperParse
        );
    }
}

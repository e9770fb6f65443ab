//! The weights contract of a compiled graph and the plan that binds a user's
//! weights to it.
//!
//! AOTInductor's constant table holds only the constants the compiled code
//! reads: it drops what the graph never uses (a VAE's encoder when the decoder
//! was exported, BatchNorm's `num_batches_tracked`), keeps one name of weights
//! that share storage (tied embeddings), and binds non-persistent buffers that
//! no `state_dict()` holds. The contract records, at mint, what the exported
//! program knew about every declared constant, so that binding can take the
//! checkpoints users actually have:
//!
//! - the kind of every declared fqn (`parameter`, `buffer`,
//!   `non_persistent_buffer`, `constant`);
//! - alias groups: declared names that share storage in the exported program;
//! - `dropped`: declared names the compiled table does not bind (and no alias
//!   of theirs does).
//!
//! It travels inside `model.pt2` as the member `<root>/extra/torch-compiled-graphs.json`
//! (the package annex), a name outside every AOTInductor layout (SPEC-v1 §8.2),
//! so readers that do not know it ignore it and the metadata (and the key) are
//! unchanged. An artifact without an annex gets the contract its metadata
//! implies: kinds unknown, no aliases, `dropped` = declared fqns the table
//! lacks.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use tcg_cj::{Map, Value};

use super::metadata::{ConstantRow, ConstantSource, Metadata};
use crate::error::{Code, Error, Result};

/// The annex's file name under the package root.
pub const ANNEX_FILE: &str = "extra/torch-compiled-graphs.json";
/// The annex format version (member `annex`).
pub const ANNEX_VERSION: i64 = 1;
/// The weights block's format version (member `v`).
pub const WEIGHTS_VERSION: i64 = 1;
/// The most bytes an annex may hold.
pub const MAX_ANNEX_BYTES: u64 = 16 << 20;

/// What a declared constant is in the exported program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConstantKind {
    /// An `nn.Parameter`.
    Parameter,
    /// A persistent buffer (in `state_dict()`).
    Buffer,
    /// A buffer registered with `persistent=False`: in no `state_dict()`.
    NonPersistentBuffer,
    /// A lifted tensor constant (a literal of the artifact).
    Constant,
    /// Not recorded (an artifact without an annex).
    Unknown,
}

impl ConstantKind {
    /// The recorded spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ConstantKind::Parameter => "parameter",
            ConstantKind::Buffer => "buffer",
            ConstantKind::NonPersistentBuffer => "non_persistent_buffer",
            ConstantKind::Constant => "constant",
            ConstantKind::Unknown => "unknown",
        }
    }

    /// Parse a recorded spelling (`unknown` is never recorded).
    pub fn parse(s: &str) -> Option<ConstantKind> {
        Some(match s {
            "parameter" => ConstantKind::Parameter,
            "buffer" => ConstantKind::Buffer,
            "non_persistent_buffer" => ConstantKind::NonPersistentBuffer,
            "constant" => ConstantKind::Constant,
            _ => return None,
        })
    }
}

fn invalid(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactAnnexInvalid,
        format!("the package annex is invalid: {what}"),
    )
}

/// The weights contract of one artifact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsContract {
    kinds: BTreeMap<String, ConstantKind>,
    groups: Vec<BTreeSet<String>>,
    group_of: BTreeMap<String, usize>,
    /// The table's `state_dict` rows, in table order.
    bound: Vec<String>,
    dropped: BTreeSet<String>,
    recorded: bool,
}

/// The declared constant fqns of validated metadata.
pub fn declared_fqns(metadata: &Metadata) -> Result<BTreeSet<String>> {
    declared_of(metadata.declaration())
}

/// The declared constant fqns (`graph.constant_fqns`) of a declaration.
pub fn declared_of(
    declaration: &crate::identity::GraphClassDeclaration,
) -> Result<BTreeSet<String>> {
    let fqns = declaration
        .graph()
        .get("constant_fqns")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("the declaration has no constant_fqns"))?;
    fqns.iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| invalid("constant_fqns holds a non-string"))
        })
        .collect()
}

fn state_dict_rows(rows: &[ConstantRow]) -> Vec<String> {
    rows.iter()
        .filter(|r| r.source == ConstantSource::StateDict)
        .map(|r| r.fqn.clone())
        .collect()
}

fn str_list(v: &Value, what: &str) -> Result<Vec<String>> {
    let items = v
        .as_array()
        .ok_or_else(|| invalid(format_args!("{what} is not an array")))?;
    items
        .iter()
        .map(|i| {
            i.as_str()
                .map(str::to_owned)
                .ok_or_else(|| invalid(format_args!("{what} holds a non-string")))
        })
        .collect()
}

impl WeightsContract {
    fn assemble(
        declared: &BTreeSet<String>,
        rows: &[ConstantRow],
        kinds: BTreeMap<String, ConstantKind>,
        groups: Vec<BTreeSet<String>>,
        recorded: bool,
    ) -> Result<WeightsContract> {
        let mut group_of = BTreeMap::new();
        for (i, g) in groups.iter().enumerate() {
            if g.len() < 2 {
                return Err(invalid("an alias group has fewer than two names"));
            }
            for name in g {
                if !declared.contains(name) {
                    return Err(invalid(format_args!(
                        "alias {name:?} is not a declared constant"
                    )));
                }
                if group_of.insert(name.clone(), i).is_some() {
                    return Err(invalid(format_args!("{name:?} is in two alias groups")));
                }
            }
        }
        let bound = state_dict_rows(rows);
        let mut covered: BTreeSet<&str> = BTreeSet::new();
        for fqn in &bound {
            match group_of.get(fqn) {
                Some(&g) => covered.extend(groups[g].iter().map(String::as_str)),
                None => {
                    covered.insert(fqn.as_str());
                }
            }
        }
        for fqn in &bound {
            if !declared.contains(fqn) {
                return Err(invalid(format_args!(
                    "the table binds {fqn:?}, which the declaration does not name"
                )));
            }
        }
        let dropped: BTreeSet<String> = declared
            .iter()
            .filter(|d| !covered.contains(d.as_str()))
            .filter(|d| kinds.get(*d) != Some(&ConstantKind::Constant))
            .cloned()
            .collect();
        Ok(WeightsContract {
            kinds,
            groups,
            group_of,
            bound,
            dropped,
            recorded,
        })
    }

    /// The contract an artifact without an annex implies.
    pub fn implied(declared: &BTreeSet<String>, rows: &[ConstantRow]) -> Result<WeightsContract> {
        let literal: BTreeSet<&str> = rows
            .iter()
            .filter(|r| r.source == ConstantSource::Literal)
            .map(|r| r.fqn.as_str())
            .collect();
        let kinds = declared
            .iter()
            .map(|d| {
                let kind = if literal.contains(d.as_str()) {
                    ConstantKind::Constant
                } else {
                    ConstantKind::Unknown
                };
                (d.clone(), kind)
            })
            .collect();
        Self::assemble(declared, rows, kinds, Vec::new(), false)
    }

    /// The strictest contract, from the constant table alone (no declaration
    /// at hand): the weights must hold exactly the table's `state_dict` rows.
    pub fn from_rows(rows: &[ConstantRow]) -> WeightsContract {
        let kinds: BTreeMap<String, ConstantKind> = rows
            .iter()
            .filter(|r| r.source != ConstantSource::Computed)
            .map(|r| {
                let kind = if r.source == ConstantSource::Literal {
                    ConstantKind::Constant
                } else {
                    ConstantKind::Unknown
                };
                (r.fqn.clone(), kind)
            })
            .collect();
        let declared: BTreeSet<String> = kinds.keys().cloned().collect();
        Self::assemble(&declared, rows, kinds, Vec::new(), false)
            .expect("a table's own rows are a consistent contract")
    }

    /// Build the weights block at mint from the exported program's facts:
    /// `{"kinds": {fqn: kind}, "alias_groups": [[fqn, ...], ...]}`, checked
    /// against the declaration and the package's constant table.
    pub fn from_facts(
        facts: &Value,
        declaration_fqns: &BTreeSet<String>,
        rows: &[ConstantRow],
    ) -> Result<WeightsContract> {
        let obj = facts
            .as_object()
            .ok_or_else(|| invalid("the weights facts are not an object"))?;
        let kinds_v = obj
            .get("kinds")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("kinds is not an object"))?;
        let mut kinds = BTreeMap::new();
        for (name, k) in kinds_v {
            let kind = k
                .as_str()
                .and_then(ConstantKind::parse)
                .ok_or_else(|| invalid(format_args!("{name:?} has an unknown kind {k:?}")))?;
            kinds.insert(name.clone(), kind);
        }
        let names: BTreeSet<String> = kinds.keys().cloned().collect();
        if &names != declaration_fqns {
            let extra: Vec<_> = names.difference(declaration_fqns).collect();
            let missing: Vec<_> = declaration_fqns.difference(&names).collect();
            return Err(invalid(format_args!(
                "kinds do not name exactly the declared constants (extra {extra:?}, missing {missing:?})"
            )));
        }
        let mut groups = Vec::new();
        if let Some(g) = obj.get("alias_groups") {
            let arr = g
                .as_array()
                .ok_or_else(|| invalid("alias_groups is not an array"))?;
            for item in arr {
                let names = str_list(item, "an alias group")?;
                let set: BTreeSet<String> = names.iter().cloned().collect();
                if set.len() != names.len() {
                    return Err(invalid("an alias group repeats a name"));
                }
                groups.push(set);
            }
        }
        groups.sort();
        Self::assemble(declaration_fqns, rows, kinds, groups, true)
    }

    /// Read the weights block of an annex, checked against the declared
    /// constant fqns and the metadata's constant rows.
    pub fn from_block(
        block: &Value,
        declared: &BTreeSet<String>,
        rows: &[ConstantRow],
    ) -> Result<WeightsContract> {
        let obj = block
            .as_object()
            .ok_or_else(|| invalid("weights is not an object"))?;
        let allowed = ["alias_groups", "dropped", "kinds", "v"];
        if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(invalid(format_args!("weights has an unknown member {k:?}")));
        }
        if obj.get("v").and_then(Value::as_i64) != Some(WEIGHTS_VERSION) {
            return Err(invalid(format_args!("weights.v is not {WEIGHTS_VERSION}")));
        }
        let contract = Self::from_facts(block, declared, rows)?;
        // The stored form is canonical: groups sorted, `dropped` restating the derivation.
        let stored_groups = match obj.get("alias_groups") {
            Some(v) => v.clone(),
            None => return Err(invalid("weights has no alias_groups")),
        };
        if stored_groups != contract.groups_value() {
            return Err(invalid("alias_groups are not sorted canonical groups"));
        }
        let dropped = str_list(
            obj.get("dropped")
                .ok_or_else(|| invalid("weights has no dropped"))?,
            "dropped",
        )?;
        if dropped != contract.dropped.iter().cloned().collect::<Vec<_>>() {
            return Err(invalid(
                "dropped does not restate the declared names the table does not bind",
            ));
        }
        Ok(contract)
    }

    fn groups_value(&self) -> Value {
        Value::Array(
            self.groups
                .iter()
                .map(|g| Value::Array(g.iter().cloned().map(Value::Str).collect()))
                .collect(),
        )
    }

    /// The weights block as stored in the annex.
    pub fn to_block(&self) -> Value {
        let mut m = Map::new();
        m.insert("v".into(), Value::Int(WEIGHTS_VERSION));
        m.insert(
            "kinds".into(),
            Value::Object(
                self.kinds
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::Str(v.as_str().into())))
                    .collect(),
            ),
        );
        m.insert("alias_groups".into(), self.groups_value());
        m.insert(
            "dropped".into(),
            Value::Array(self.dropped.iter().cloned().map(Value::Str).collect()),
        );
        Value::Object(m)
    }

    /// The contract as Python and the CLI show it: the stored block plus
    /// `recorded` (false for an implied contract) and `bound` (the names the
    /// weights must provide, in table order).
    pub fn to_report(&self) -> Value {
        let mut v = match self.to_block() {
            Value::Object(m) => m,
            _ => unreachable!("to_block returns an object"),
        };
        v.insert("recorded".into(), Value::Bool(self.recorded));
        v.insert(
            "bound".into(),
            Value::Array(self.bound.iter().cloned().map(Value::Str).collect()),
        );
        Value::Object(v)
    }

    /// Whether the contract was recorded at mint (else implied by the metadata).
    pub fn recorded(&self) -> bool {
        self.recorded
    }

    /// The kind of a declared name.
    pub fn kind(&self, fqn: &str) -> Option<ConstantKind> {
        self.kinds.get(fqn).copied()
    }

    /// The names the weights must provide (the table's `state_dict` rows).
    pub fn bound(&self) -> &[String] {
        &self.bound
    }

    /// The declared names the table does not bind.
    pub fn dropped(&self) -> &BTreeSet<String> {
        &self.dropped
    }

    /// The other names of `fqn`'s alias group (empty when it has none).
    pub fn aliases(&self, fqn: &str) -> Vec<&str> {
        match self.group_of.get(fqn) {
            Some(&g) => self.groups[g]
                .iter()
                .map(String::as_str)
                .filter(|n| *n != fqn)
                .collect(),
            None => Vec::new(),
        }
    }

    /// Plan the binding of a set of provided names: which provided name binds
    /// each table row, which provided names are ignored (declared but dropped),
    /// and the refusals: a provided name foreign to the declaration
    /// (`run.constant_unexpected`), a row no name provides
    /// (`run.constant_missing`, explained by the row's kind).
    pub fn plan<'a, I>(&self, provided: I) -> Result<BindingPlan>
    where
        I: IntoIterator<Item = &'a str>,
    {
        let provided: BTreeSet<&str> = provided.into_iter().collect();
        let mut bind = Vec::with_capacity(self.bound.len());
        let mut duplicates = Vec::new();
        let mut missing = Vec::new();
        for fqn in &self.bound {
            let mut names: Vec<&str> = Vec::new();
            if provided.contains(fqn.as_str()) {
                names.push(fqn);
            }
            names.extend(
                self.aliases(fqn)
                    .into_iter()
                    .filter(|a| provided.contains(a)),
            );
            match names.split_first() {
                Some((first, rest)) => {
                    bind.push((fqn.clone(), (*first).to_owned()));
                    for other in rest {
                        duplicates.push(((*first).to_owned(), (*other).to_owned()));
                    }
                }
                None => missing.push(fqn.as_str()),
            }
        }
        if !missing.is_empty() {
            return Err(Error::new(
                Code::RunConstantMissing,
                self.explain_missing(&missing, &provided),
            ));
        }
        let foreign: Vec<&str> = provided
            .iter()
            .copied()
            .filter(|n| !self.kinds.contains_key(*n))
            .collect();
        if !foreign.is_empty() {
            let mut msg = format!(
                "the weights hold {} name(s) the graph's declaration has no constant for: {}",
                foreign.len(),
                list(&foreign)
            );
            if let Some(hint) = self.prefix_hint(&foreign, &provided) {
                let _ = write!(msg, "; {hint}");
            }
            return Err(Error::new(Code::RunConstantUnexpected, msg));
        }
        let bound_names: BTreeSet<&str> = bind
            .iter()
            .map(|(_, n)| n.as_str())
            .chain(duplicates.iter().map(|(_, n)| n.as_str()))
            .collect();
        let ignored = provided
            .iter()
            .filter(|n| !bound_names.contains(**n))
            .map(|n| (*n).to_owned())
            .collect();
        Ok(BindingPlan {
            bind,
            duplicates,
            ignored,
        })
    }

    fn prefix_hint(&self, foreign: &[&str], provided: &BTreeSet<&str>) -> Option<String> {
        // A checkpoint of a pipeline (`unet.…`) or of a wrapper: a prefix that,
        // stripped from every foreign name, leaves declared names.
        let first = foreign[0];
        for (i, _) in first.match_indices('.') {
            let prefix = &first[..=i];
            let stripped: Vec<&str> = provided
                .iter()
                .filter_map(|n| n.strip_prefix(prefix))
                .collect();
            if !stripped.is_empty() && stripped.iter().all(|s| self.kinds.contains_key(*s)) {
                return Some(format!(
                    "they look like this graph's names under the prefix {prefix:?}: pass strip_prefix={prefix:?}"
                ));
            }
        }
        // The other way: declared names under a prefix the checkpoint lacks.
        let declared = self.bound.first()?;
        for (i, _) in declared.match_indices('.') {
            let prefix = &declared[..=i];
            if foreign
                .iter()
                .all(|f| self.kinds.contains_key(&format!("{prefix}{f}")))
            {
                return Some(format!(
                    "the graph names them under the prefix {prefix:?}: pass add_prefix={prefix:?}"
                ));
            }
        }
        None
    }

    fn explain_missing(&self, missing: &[&str], provided: &BTreeSet<&str>) -> String {
        let mut by_kind: BTreeMap<ConstantKind, Vec<&str>> = BTreeMap::new();
        for m in missing {
            by_kind
                .entry(self.kind(m).unwrap_or(ConstantKind::Unknown))
                .or_default()
                .push(m);
        }
        let mut parts = Vec::new();
        for (kind, names) in &by_kind {
            let part = match kind {
                ConstantKind::NonPersistentBuffer => format!(
                    "{} non-persistent buffer(s) {} (registered with persistent=False: no state_dict() or save_pretrained() checkpoint holds them; bind with load(module), or write them once with graph.write_weights(module, path, non_persistent_only=True) and pass that file with the checkpoint)",
                    names.len(),
                    list(names)
                ),
                ConstantKind::Parameter | ConstantKind::Buffer => {
                    let with_aliases: Vec<String> = names
                        .iter()
                        .map(|n| {
                            let a = self.aliases(n);
                            if a.is_empty() {
                                format!("{n:?}")
                            } else {
                                format!("{n:?} (or its alias {})", list(&a))
                            }
                        })
                        .collect();
                    format!(
                        "{} {}(s) {} (the checkpoint is of another model, or it names them under another prefix)",
                        names.len(),
                        kind.as_str(),
                        capped(&with_aliases)
                    )
                }
                ConstantKind::Constant | ConstantKind::Unknown => {
                    format!("{} constant(s) {}", names.len(), list(names))
                }
            };
            parts.push(part);
        }
        let mut msg = format!(
            "the weights lack constants the graph needs: {}",
            parts.join("; ")
        );
        if provided.is_empty() {
            msg.push_str("; the weights are empty");
        } else {
            let foreign: Vec<&str> = missing.to_vec();
            if let Some(hint) = self.prefix_hint_missing(&foreign, provided) {
                let _ = write!(msg, "; {hint}");
            }
        }
        msg
    }

    fn prefix_hint_missing(&self, missing: &[&str], provided: &BTreeSet<&str>) -> Option<String> {
        let m = missing[0];
        provided.iter().find_map(|p| {
            p.strip_suffix(m)
                .filter(|pre| !pre.is_empty() && pre.ends_with('.'))
                .map(|pre| format!("the weights hold {p:?}: pass strip_prefix={pre:?}"))
                .or_else(|| {
                    m.strip_suffix(p)
                        .filter(|pre| !pre.is_empty() && pre.ends_with('.'))
                        .map(|pre| format!("the weights hold {p:?}: pass add_prefix={pre:?}"))
                })
        })
    }
}

fn quoted(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| format!("{n:?}")).collect()
}

fn capped(items: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = items
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > SHOWN {
        let _ = write!(s, " and {} more", items.len() - SHOWN);
    }
    format!("[{s}]")
}

fn list(names: &[&str]) -> String {
    capped(&quoted(names))
}

/// How a set of provided names binds a contract.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindingPlan {
    /// `(table fqn, provided name)` for every row the weights must provide,
    /// in table order.
    pub bind: Vec<(String, String)>,
    /// `(bound name, another provided alias of it)`: both provided; the
    /// caller checks they hold the same value.
    pub duplicates: Vec<(String, String)>,
    /// Provided names the graph does not bind (declared, dropped by the
    /// compiler), sorted.
    pub ignored: Vec<String>,
}

/// The annex's canonical bytes for a weights contract (and nothing else).
pub fn annex_bytes(contract: &WeightsContract) -> Result<Vec<u8>> {
    let mut m = Map::new();
    m.insert("annex".into(), Value::Int(ANNEX_VERSION));
    m.insert("weights".into(), contract.to_block());
    tcg_cj::to_canonical(&Value::Object(m))
        .map_err(|e| invalid(format_args!("cannot encode the annex: {e}")))
}

/// Parse annex bytes (strict, canonical) and check the weights block against
/// `metadata`. Unknown top-level members are ignored (a later version's
/// blocks); `annex` must be this version.
pub fn parse_annex(
    bytes: &[u8],
    declared: &BTreeSet<String>,
    rows: &[ConstantRow],
) -> Result<Option<WeightsContract>> {
    let value = tcg_cj::parse_strict(bytes).map_err(invalid)?;
    let canonical =
        tcg_cj::to_canonical(&value).map_err(|e| invalid(format_args!("not encodable: {e}")))?;
    if canonical != bytes {
        return Err(invalid("it is not canonical JSON"));
    }
    let obj = value
        .as_object()
        .ok_or_else(|| invalid("it is not an object"))?;
    if obj.get("annex").and_then(Value::as_i64) != Some(ANNEX_VERSION) {
        return Err(invalid(format_args!("annex is not {ANNEX_VERSION}")));
    }
    match obj.get("weights") {
        Some(block) => WeightsContract::from_block(block, declared, rows).map(Some),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(fqn: &str, source: ConstantSource) -> ConstantRow {
        ConstantRow {
            fqn: fqn.into(),
            source,
            dtype: "float32".into(),
            shape: vec![2],
        }
    }

    /// The facts a mint hands over: kinds by name and alias groups.
    fn facts<G: AsRef<[&'static str]>>(kinds: &[(&str, &str)], groups: &[G]) -> Value {
        let mut k = Map::new();
        for (n, kind) in kinds {
            k.insert((*n).into(), Value::Str((*kind).into()));
        }
        let groups = groups
            .iter()
            .map(|g| Value::Array(g.as_ref().iter().map(|s| Value::Str((*s).into())).collect()))
            .collect();
        let mut m = Map::new();
        m.insert("kinds".into(), Value::Object(k));
        m.insert("alias_groups".into(), Value::Array(groups));
        Value::Object(m)
    }

    fn declared(kinds: &[(&str, &str)]) -> BTreeSet<String> {
        kinds.iter().map(|(n, _)| (*n).to_owned()).collect()
    }

    fn contract(
        kinds: &[(&str, &str)],
        groups: &[&[&'static str]],
        table: &[&str],
    ) -> WeightsContract {
        let rows: Vec<_> = table
            .iter()
            .map(|t| row(t, ConstantSource::StateDict))
            .collect();
        WeightsContract::from_facts(&facts(kinds, groups), &declared(kinds), &rows).unwrap()
    }

    fn llama() -> WeightsContract {
        contract(
            &[
                ("embed.weight", "parameter"),
                ("head.weight", "parameter"),
                ("rope.inv_freq", "non_persistent_buffer"),
                ("rope.original_inv_freq", "non_persistent_buffer"),
            ],
            &[&["embed.weight", "head.weight"]],
            &["head.weight", "rope.inv_freq"],
        )
    }

    #[test]
    fn an_alias_binds_a_tied_weight_and_dropped_names_are_ignored() {
        let c = llama();
        assert_eq!(
            c.dropped().iter().collect::<Vec<_>>(),
            ["rope.original_inv_freq"]
        );
        let plan = c
            .plan(["embed.weight", "rope.inv_freq", "rope.original_inv_freq"])
            .unwrap();
        assert_eq!(
            plan.bind,
            vec![
                ("head.weight".into(), "embed.weight".into()),
                ("rope.inv_freq".into(), "rope.inv_freq".into())
            ]
        );
        assert_eq!(plan.ignored, vec!["rope.original_inv_freq".to_string()]);
        // Both names of a tied pair: the table's own binds, the other is checked.
        let plan = c
            .plan(["embed.weight", "head.weight", "rope.inv_freq"])
            .unwrap();
        assert_eq!(plan.bind[0], ("head.weight".into(), "head.weight".into()));
        assert_eq!(
            plan.duplicates,
            vec![("head.weight".into(), "embed.weight".into())]
        );
    }

    #[test]
    fn a_missing_non_persistent_buffer_is_explained_with_the_fix() {
        let e = llama().plan(["embed.weight"]).unwrap_err();
        assert_eq!(e.code(), Code::RunConstantMissing);
        assert!(e.message().contains("non-persistent buffer"), "{e}");
        assert!(e.message().contains("write_weights"), "{e}");
        assert!(e.message().contains("rope.inv_freq"), "{e}");
    }

    #[test]
    fn a_foreign_name_is_refused_and_a_prefix_is_suggested() {
        // Nothing binds: the names the graph needs are missing, the prefix explains why.
        let e = llama()
            .plan(["vae.embed.weight", "vae.head.weight", "vae.rope.inv_freq"])
            .unwrap_err();
        assert_eq!(e.code(), Code::RunConstantMissing);
        assert!(e.message().contains("strip_prefix=\"vae.\""), "{e}");
        // Everything binds, and one name belongs to no declared constant.
        let e = llama()
            .plan(["head.weight", "rope.inv_freq", "bogus"])
            .unwrap_err();
        assert_eq!(e.code(), Code::RunConstantUnexpected);
        assert!(e.message().contains("bogus"), "{e}");
    }

    #[test]
    fn facts_that_do_not_restate_the_declaration_are_refused() {
        let only_a: BTreeSet<String> = ["a".to_string()].into();
        let no_groups: [&[&str]; 0] = [];
        let e =
            WeightsContract::from_facts(&facts(&[("b", "parameter")], &no_groups), &only_a, &[])
                .unwrap_err();
        assert_eq!(e.code(), Code::ArtifactAnnexInvalid);
        // An alias outside the declaration, a name in two groups, a kind nobody knows.
        for (kinds, groups) in [
            (vec![("a", "parameter")], vec![vec!["a", "z"]]),
            (
                vec![("a", "parameter"), ("b", "parameter"), ("c", "parameter")],
                vec![vec!["a", "b"], vec!["b", "c"]],
            ),
            (vec![("a", "weight")], vec![]),
        ] {
            let e = WeightsContract::from_facts(&facts(&kinds, &groups), &declared(&kinds), &[])
                .unwrap_err();
            assert_eq!(e.code(), Code::ArtifactAnnexInvalid, "{e}");
        }
    }

    #[test]
    fn the_block_round_trips_through_its_stored_form() {
        let c = llama();
        let block = c.to_block();
        let declared: BTreeSet<String> = c.kinds.keys().cloned().collect();
        let rows: Vec<_> = c
            .bound
            .iter()
            .map(|t| row(t, ConstantSource::StateDict))
            .collect();
        let again = WeightsContract::from_facts(&block, &declared, &rows).unwrap();
        assert_eq!(again, c);
    }
}

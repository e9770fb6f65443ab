//! The miss path of `ensure` (SPEC-v1 §10.3): single-flight, the caller's
//! mint callback, packing, publication, resolution and the plan check.

use std::fs::File;
use std::path::{Path, PathBuf};

use tcg_cj::Value;

use super::{
    check_key, store_err, Engine, EnsureOutcome, EnsureResult, Request, Resolved, StoreOutcome,
    StoreResult,
};
use crate::artifact::literals::{write_payload, LiteralTensor};
use crate::artifact::metadata::build_metadata;
use crate::artifact::package::mint_record::{build_mint_record, write_with_record};
use crate::artifact::package::package_native_calls;
use crate::artifact::{pack, parse_constant_table, Metadata};
use crate::host_isa::HostIsa;
use crate::identity::{toolchain_axis, validate_toolchain_block, GraphClassDeclaration};
use crate::{Code, Error, Kind, Result};

/// A literal constant's value, written into `constants.safetensors`.
pub type MintedLiteral = LiteralTensor;

/// What a mint callback hands back: a compiled package and the facts it was
/// compiled under.
#[derive(Debug, Clone)]
pub struct MintOutput {
    /// The AOTInductor package (`model.pt2`) the compile produced.
    pub package: PathBuf,
    /// The declaration the compile was planned from.
    pub declaration: GraphClassDeclaration,
    /// The `sm` axis of the runtime.
    pub sm: String,
    /// The runtime's toolchain block.
    pub toolchain: Value,
    /// The host-ISA requirement the compile was clamped to.
    pub host_isa: HostIsa,
    /// Values of the package's literal constants, by wrapper fqn.
    pub literals: Vec<MintedLiteral>,
    /// The canonical lines behind the declaration's graph witness, kept for
    /// explaining later misses (`None` when the caller has none).
    pub witness_lines: Option<Vec<String>>,
    /// The exported program's facts about its constants (kinds, alias
    /// groups; `artifact::weights::WeightsContract::from_facts`), written into
    /// the package annex before packing (`None`: no annex, as 0.2.0 minted).
    pub weights: Option<Value>,
    /// The parity figures of the mint (the `parity` block of the mint
    /// record, docs/engine.md "Parity at mint"); `None` when the caller did
    /// not check parity.
    pub parity: Option<Value>,
}

fn plan_mismatches(md: &Metadata, plan: &MintOutput, key: &str) -> Vec<&'static str> {
    let got = md.declaration();
    let want = &plan.declaration;
    let mut bad = Vec::new();
    let mut check = |name: &'static str, same: bool| {
        if !same {
            bad.push(name);
        }
    };
    check("target", got.target() == want.target());
    check("class_hash", got.class_hash() == want.class_hash());
    check("graph", got.graph() == want.graph());
    check("graph_witness", got.graph_witness() == want.graph_witness());
    check("range_digest", got.range_digest() == want.range_digest());
    check("fork", got.fork() == want.fork());
    check("class_dims", got.class_dims() == want.class_dims());
    check("strict", got.strict() == want.strict());
    check("lora_bucket", got.lora_bucket() == want.lora_bucket());
    check(
        "literal_values",
        got.literal_values() == want.literal_values(),
    );
    check("placement", got.placement() == want.placement());
    check("sm", md.sm() == plan.sm);
    let planned_axis = validate_toolchain_block(&plan.toolchain, Code::DeclarationToolchainInvalid)
        .map(|b| toolchain_axis(&b))
        .unwrap_or_default();
    check("toolchain", toolchain_axis(md.toolchain()) == planned_axis);
    check("compiled_graph_key", md.key() == key);
    bad
}

impl Engine {
    fn hit(
        &self,
        key: &str,
        destination: &Path,
        request: &Request,
        remote: bool,
    ) -> Result<Option<Resolved>> {
        match self.resolve_tiered(key, destination, Some(request), remote) {
            Ok(found) => Ok(found),
            Err(e) if e.kind() == Kind::Quarantined => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Resolve `key`, and on a miss mint it once (SPEC-v1 §10.3). `mint` is
    /// called at most once, only on a miss, while this process holds the key's
    /// single-flight lock; it runs the caller's recipe and the sole compile
    /// policy and returns the package and its facts.
    pub fn ensure(
        &self,
        key: &str,
        destination: &Path,
        request: &Request,
        mint: &mut dyn FnMut() -> Result<MintOutput>,
    ) -> Result<EnsureResult> {
        check_key(key)?;
        // Local only: the remote is consulted once, under the local lock
        // below, so that a failing or bad remote record costs one fetch (one
        // warning, one piece of evidence) per `ensure`, and local processes
        // racing on one key fetch it once.
        if let Some(resolved) = self.hit(key, destination, request, false)? {
            return Ok(EnsureResult {
                outcome: EnsureOutcome::Reused,
                resolved,
                publication: None,
                remote_publication: None,
            });
        }
        let _lock = self
            .store
            .lock_named(key, self.lock_timeout)
            .map_err(store_err)?;
        if let Some(resolved) = self.hit(key, destination, request, true)? {
            return Ok(EnsureResult {
                outcome: EnsureOutcome::Reused,
                resolved,
                publication: None,
                remote_publication: None,
            });
        }
        let flight = self.remote.as_ref().map(|r| r.begin_flight(key));
        if matches!(flight, Some(super::Flight::Follow)) {
            // A trusting follower waits for a signed record: the ref may
            // name an artifact its policy refuses.
            let appeared = self
                .remote
                .as_ref()
                .is_some_and(|r| match self.trust().policy() {
                    Some(p) => r.await_signed(key, &p.allowed().fingerprints_hex()),
                    None => r.await_flight(key),
                });
            if appeared {
                if let Some(resolved) = self.hit(key, destination, request, true)? {
                    return Ok(EnsureResult {
                        outcome: EnsureOutcome::Reused,
                        resolved,
                        publication: None,
                        remote_publication: None,
                    });
                }
            }
            // The leader did not publish in time: compile anyway.
        }
        let plan = mint()?;
        let publication = self.publish_mint(key, &plan)?;
        if let Some(lines) = &plan.witness_lines {
            // Best effort: the lines only serve explanations of later misses.
            let _ = self.record_witness_lines(key, plan.declaration.graph_witness(), lines);
        }
        let resolved = self
            .resolve_with(key, destination, Some(request))?
            .ok_or_else(|| {
                Error::new(
                    Code::StoreRefMoved,
                    format!("the record of {key} disappeared after publication"),
                )
            })?;
        let bad = plan_mismatches(&resolved.metadata, &plan, key);
        if !bad.is_empty() {
            return Err(Error::new(
                Code::AdmissionPlanMismatch,
                format!(
                    "artifact does not satisfy the exact graph plan: {}",
                    bad.join(", ")
                ),
            ));
        }
        // Publish before the fleet lease is released, so that followers find
        // the ref when the lease goes.
        let remote_publication = self.publish_remote(key, &resolved.manifest);
        if remote_publication.is_some() && self.trust().has_signer() {
            // Whatever the ref's outcome (DIVERGENT included): the records
            // make this mint reachable for trusting workers.
            self.publish_remote_signatures(key);
        }
        drop(flight);
        let mut resolved = resolved;
        if publication.outcome != StoreOutcome::Divergent {
            resolved.source = super::Source::Compiled;
        }
        let outcome = if publication.outcome == StoreOutcome::Divergent {
            EnsureOutcome::Reused
        } else {
            self.count(super::Counter::Mint);
            EnsureOutcome::Minted
        };
        Ok(EnsureResult {
            outcome,
            resolved,
            publication: Some(publication),
            remote_publication,
        })
    }

    /// Pack a minted package with its metadata and literal payload, verify the
    /// envelope once while ingesting it, and publish it under `key`.
    pub fn publish_mint(&self, key: &str, plan: &MintOutput) -> Result<StoreResult> {
        check_key(key)?;
        let rows = parse_constant_table(&plan.package)?;
        // Checked before anything is staged: facts that contradict the
        // declaration or the table refuse the mint.
        let contract = match &plan.weights {
            Some(facts) => {
                let declared = crate::artifact::weights::declared_of(&plan.declaration)?;
                Some(crate::artifact::weights::WeightsContract::from_facts(
                    facts, &declared, &rows,
                )?)
            }
            None => None,
        };
        let metadata = build_metadata(
            &plan.declaration,
            &rows,
            &plan.sm,
            &plan.toolchain,
            &plan.host_isa,
        )?;
        if metadata.key() != key {
            return Err(Error::new(
                Code::AdmissionRecipeKeyMismatch,
                format!(
                    "lazy recipe derives {}, not requested key {key:?}",
                    metadata.key()
                ),
            ));
        }
        let lease = self.store.lease().map_err(store_err)?;
        let work = super::StoreStage::new(self, &lease)?;
        let payload = if plan.literals.is_empty() {
            None
        } else {
            let path = work.path().join(crate::artifact::LITERALS_MEMBER);
            let mut f = File::create(&path)
                .map_err(|e| Error::io(format_args!("cannot create {}", path.display()), &e))?;
            write_payload(&mut f, &plan.literals).map_err(|e| {
                if e.kind() == Kind::Io {
                    e
                } else {
                    Error::new(
                        Code::AdmissionLiteralSerialize,
                        format!("cannot serialise literal constants: {}", e.message()),
                    )
                }
            })?;
            Some(path)
        };
        // The mint record rides in the package (docs/FORMAT.md, "The mint
        // record"): what the native path cannot run, and the parity figures.
        let calls = package_native_calls(&plan.package)?;
        let record = build_mint_record(plan.parity.as_ref(), &calls)?;
        let package = work.path().join(crate::artifact::PACKAGE_MEMBER);
        write_with_record(&plan.package, &package, &record)?;
        // The weights contract rides beside it (docs/FORMAT.md, "The package annex").
        if let Some(contract) = &contract {
            crate::artifact::package::append_annex(&package, contract)?;
        }
        let envelope = work.path().join(crate::artifact::ENVELOPE_FILE_NAME);
        pack(
            &package,
            &Value::Object(metadata.value().clone()),
            payload.as_deref(),
            &envelope,
        )?;
        let file = File::open(&envelope)
            .map_err(|e| Error::io(format_args!("cannot open {}", envelope.display()), &e))?;
        let (info, report, stage) = self.ingest_verified(&lease, file, key, true)?;
        let m = info.manifest;
        // A mint by this store is admitted whatever the policy: recorded
        // before the ref, so a trusting engine never finds it unadmitted.
        self.record_admission(&lease, key, &m, &super::Basis::Minted)?;
        let result = self.decide(&lease, key, m)?;
        if result.outcome != StoreOutcome::Divergent {
            // A mint by this node: signed when a signing key is configured.
            // The artifact is published already: a signing failure must not
            // lose it (a warning and a counter; `sign` can vouch later).
            let subject = super::subject_of(&report.metadata, &info.file_digest);
            if let Err(e) = self.sign_with_config(&lease, &subject) {
                eprintln!(
                    "torch-compiled-graphs: warning: {key}: the mint is published but signing it failed: {}",
                    e.message()
                );
                self.count(super::Counter::SigningFailure);
            }
        }
        self.after_publication(&lease, key, &m, &result, &stage);
        drop(stage);
        drop(work);
        lease.end().map_err(store_err)?;
        Ok(result)
    }
}

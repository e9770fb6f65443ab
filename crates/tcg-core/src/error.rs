//! The error type of `tcg-core` (SPEC-v1 §12).
//!
//! Every failure has a [`Kind`] (which Python exception class it becomes) and a
//! stable [`Code`] (`<area>.<slug>`). Messages are for people; codes are for
//! programs. A new failure gets a new code; existing codes never change meaning.

use std::fmt;

/// The kind of an error: the Python exception class it maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `IdentityError` (a `ValueError`).
    Identity,
    /// `DeclarationError` (a `ValueError`).
    Declaration,
    /// `ArtifactError` (a `ValueError`).
    Artifact,
    /// `CompileError` (a `RuntimeError`).
    Compile,
    /// `StorageError` (a `RuntimeError`).
    Storage,
    /// `QuarantinedArtifact` (a `StorageError`).
    Quarantined,
    /// `AdmissionError` (a `StorageError`).
    Admission,
    /// `BindingError` (a `ValueError`): loading a resolved graph with its weights.
    Binding,
    /// `TrustError` (an `AdmissionError`): the trust policy refused an artifact's
    /// signatures, or a trust file or signing key cannot be used.
    Trust,
    /// An `OSError` subclass chosen by errno.
    Io,
}

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident => $kind:ident, $text:literal;)*) => {
        /// A stable error code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Code {
            $($(#[$doc])* #[doc = concat!("`", $text, "`")] $variant,)*
        }

        impl Code {
            /// Every code, in declaration order.
            pub const ALL: &'static [Code] = &[$(Code::$variant,)*];

            /// The code string, `<area>.<slug>`.
            pub fn as_str(self) -> &'static str {
                match self { $(Code::$variant => $text,)* }
            }

            /// The kind an error of this code has unless its context says otherwise.
            pub fn default_kind(self) -> Kind {
                match self { $(Code::$variant => Kind::$kind,)* }
            }

            /// Look a code up by its string.
            pub fn from_str_code(s: &str) -> Option<Code> {
                match s { $($text => Some(Code::$variant),)* _ => None }
            }
        }
    };
}

codes! {
    IdentityAxisUnknown => Identity, "identity.axis_unknown";
    IdentityAxisMissing => Identity, "identity.axis_missing";
    IdentityAxisNotCanonical => Identity, "identity.axis_not_canonical";
    IdentityAxisIsKey => Identity, "identity.axis_is_key";
    IdentityKeyInvalid => Identity, "identity.key_invalid";
    IdentityMetadataIncomplete => Identity, "identity.metadata_incomplete";

    CjNonFinite => Identity, "cj.non_finite";
    CjIntegerRange => Identity, "cj.integer_range";
    CjInvalidValue => Identity, "cj.invalid_value";

    DeclarationNameInvalid => Declaration, "declaration.name_invalid";
    DeclarationTargetInvalid => Declaration, "declaration.target_invalid";
    DeclarationGraphInvalid => Declaration, "declaration.graph_invalid";
    DeclarationGraphKeys => Declaration, "declaration.graph_keys";
    DeclarationGraphVersion => Declaration, "declaration.graph_version";
    DeclarationGraphList => Declaration, "declaration.graph_list";
    DeclarationGraphObject => Declaration, "declaration.graph_object";
    DeclarationWitnessInvalid => Declaration, "declaration.witness_invalid";
    DeclarationRangeDigestInvalid => Declaration, "declaration.range_digest_invalid";
    DeclarationForkInvalid => Declaration, "declaration.fork_invalid";
    DeclarationClassDimsInvalid => Declaration, "declaration.class_dims_invalid";
    DeclarationStrictInvalid => Declaration, "declaration.strict_invalid";
    DeclarationLoraBucketInvalid => Declaration, "declaration.lora_bucket_invalid";
    DeclarationLiteralValuesInvalid => Declaration, "declaration.literal_values_invalid";
    DeclarationLiteralValuesMismatch => Declaration, "declaration.literal_values_mismatch";
    DeclarationPlacementSingle => Declaration, "declaration.placement_single";
    DeclarationIngressInvalid => Declaration, "declaration.ingress_invalid";
    DeclarationIngressMismatch => Declaration, "declaration.ingress_mismatch";
    DeclarationProgramInvalid => Declaration, "declaration.program_invalid";
    DeclarationConstantFqnsMismatch => Declaration, "declaration.constant_fqns_mismatch";
    DeclarationLiteralUnreadable => Declaration, "declaration.literal_unreadable";
    DeclarationTargetUnsupported => Declaration, "declaration.target_unsupported";
    DeclarationCudaUnavailable => Declaration, "declaration.cuda_unavailable";
    DeclarationDeviceMismatch => Declaration, "declaration.device_mismatch";
    DeclarationToolchainInvalid => Declaration, "declaration.toolchain_invalid";
    /// A graph variant name that is not one of this version's (`default`, `shim-v1`).
    DeclarationVariantUnknown => Declaration, "declaration.variant_unknown";
    /// The toolchain block's `settings_declaration` names another variant's
    /// compile policy than the one requested (docs/keys.md, "Variants").
    DeclarationVariantMismatch => Declaration, "declaration.variant_mismatch";
    DeclarationHostPolicy => Declaration, "declaration.host_policy";

    ArtifactBarePt2 => Artifact, "artifact.bare_pt2";
    ArtifactCompressedTooLarge => Artifact, "artifact.compressed_too_large";
    ArtifactGzipHeader => Artifact, "artifact.gzip_header";
    ArtifactGzipInvalid => Artifact, "artifact.gzip_invalid";
    ArtifactTruncatedGzip => Artifact, "artifact.truncated_gzip";
    ArtifactGzipTrailing => Artifact, "artifact.gzip_trailing";
    ArtifactDecompressedTooLarge => Artifact, "artifact.decompressed_too_large";
    /// A stream inflates to more than the ratio cap allows for its compressed size.
    ArtifactInflationRatio => Artifact, "artifact.inflation_ratio";
    ArtifactTarHeader => Artifact, "artifact.tar_header";
    ArtifactTarMember => Artifact, "artifact.tar_member";
    ArtifactTarTruncated => Artifact, "artifact.tar_truncated";
    ArtifactTarEnd => Artifact, "artifact.tar_end";
    ArtifactMemberMissing => Artifact, "artifact.member_missing";
    ArtifactMemberTooLarge => Artifact, "artifact.member_too_large";
    ArtifactTotalTooLarge => Artifact, "artifact.total_too_large";
    ArtifactMetadataJson => Artifact, "artifact.metadata_json";
    ArtifactMetadataSchema => Artifact, "artifact.metadata_schema";
    ArtifactMetadataFormat => Artifact, "artifact.metadata_format";
    ArtifactMetadataKind => Artifact, "artifact.metadata_kind";
    ArtifactMetadataPolicy => Artifact, "artifact.metadata_policy";
    ArtifactHostIsaInvalid => Artifact, "artifact.host_isa_invalid";
    ArtifactDeclarationInvalid => Artifact, "artifact.declaration_invalid";
    ArtifactClassHashMismatch => Artifact, "artifact.class_hash_mismatch";
    ArtifactKeyMismatch => Artifact, "artifact.key_mismatch";
    ArtifactConstantsInvalid => Artifact, "artifact.constants_invalid";
    /// The package annex (`extra/torch-compiled-graphs.json`: the weights contract) is malformed or contradicts the metadata.
    ArtifactAnnexInvalid => Artifact, "artifact.annex_invalid";
    ArtifactLiteralsMismatch => Artifact, "artifact.literals_mismatch";
    ArtifactFormatUnsupported => Artifact, "artifact.format_unsupported";
    ArtifactPackageZip => Artifact, "artifact.package_zip";
    ArtifactPackageLayout => Artifact, "artifact.package_layout";
    /// The package zip lists more entries, or a larger central directory, than allowed.
    ArtifactPackageTooManyEntries => Artifact, "artifact.package_too_many_entries";
    /// A package member the verifier reads declares more bytes than its kind allows.
    ArtifactPackageMemberTooLarge => Artifact, "artifact.package_member_too_large";
    ArtifactPackageEntryMismatch => Artifact, "artifact.package_entry_mismatch";
    ArtifactWrapperParse => Artifact, "artifact.wrapper_parse";
    ArtifactConstantsMismatch => Artifact, "artifact.constants_mismatch";
    ArtifactNotCodeOnly => Artifact, "artifact.not_code_only";
    ArtifactElfInvalid => Artifact, "artifact.elf_invalid";
    ArtifactElfMachineMismatch => Artifact, "artifact.elf_machine_mismatch";
    /// A `.cubin` member of the package is not a well-formed CUDA ELF.
    ArtifactCubinInvalid => Artifact, "artifact.cubin_invalid";
    /// A `.cubin` member is built for another architecture than the artifact's `sm`.
    ArtifactCubinArchMismatch => Artifact, "artifact.cubin_arch_mismatch";
    ArtifactLiteralPayload => Artifact, "artifact.literal_payload";
    ArtifactLiteralDigestMismatch => Artifact, "artifact.literal_digest_mismatch";
    /// The package's mint record (`<root>/extra/tcg-mint.json`) is malformed or
    /// disagrees with the package (docs/FORMAT.md, "The mint record").
    ArtifactMintRecordInvalid => Artifact, "artifact.mint_record_invalid";

    CompileHostPolicy => Compile, "compile.host_policy";
    CompileProgramInvalid => Compile, "compile.program_invalid";
    CompileContext => Compile, "compile.context";
    CompileFailed => Compile, "compile.failed";
    CompileResultInvalid => Compile, "compile.result_invalid";
    CompilePackageFailed => Compile, "compile.package_failed";
    /// The graph cannot be minted as the requested libtorch-free variant: its
    /// `.so` imports what shim set v1 does not provide (an op-specific extern,
    /// a proxy-executor call, a non-system library); nothing is published
    /// (docs/keys.md, "Variants").
    CompileVariantRefused => Compile, "compile.variant_refused";
    /// The compiled graph's outputs on the program's example inputs differ
    /// from the exported program's beyond the dtype's tolerance; nothing is
    /// published (docs/engine.md, "Parity at mint").
    MintParityFailed => Compile, "mint.parity_failed";
    /// The parity check cannot run: the program has no example inputs, or
    /// the compiled graph cannot be loaded or run on them.
    MintParityUnavailable => Compile, "mint.parity_unavailable";

    StoreKeyInvalid => Storage, "store.key_invalid";
    StoreKeyMismatch => Storage, "store.key_mismatch";
    StoreAbsent => Storage, "store.absent";
    StoreRefMoved => Storage, "store.ref_moved";
    StoreMintLockTimeout => Storage, "store.mint_lock_timeout";
    StoreDigestMismatch => Storage, "store.digest_mismatch";
    StoreObjectMissing => Storage, "store.object_missing";
    StoreNotRegularFile => Storage, "store.not_regular_file";
    StoreRefInvalid => Storage, "store.ref_invalid";
    StoreClosureMissing => Storage, "store.closure_missing";
    StoreFormatUnsupported => Storage, "store.format_unsupported";
    StoreNetworkFilesystem => Storage, "store.network_filesystem";
    StoreGcAborted => Storage, "store.gc_aborted";
    /// A manifest object breaks the manifest rules (evidence against stored bytes).
    StoreManifestInvalid => Storage, "store.manifest_invalid";
    /// The root is a torch-compiled-graphs 0.2.0 (HashRepo) store: adopt it into a new root.
    StoreHashrepoRoot => Storage, "store.hashrepo_root";
    /// A store directory or file can be written by another local user.
    StoreInsecurePermissions => Storage, "store.insecure_permissions";
    /// A read-only operation named a root that holds no store.
    StoreNotFound => Storage, "store.not_found";
    /// A destination lies inside the store root.
    StoreDestinationInStore => Storage, "store.destination_in_store";
    /// `adopt`'s new store root and old (0.2.0) root overlap: one lies inside the other.
    StoreAdoptOverlap => Storage, "store.adopt_overlap";

    /// The remote URL or a remote setting is not usable.
    RemoteConfigInvalid => Storage, "remote.config_invalid";
    /// The remote tier did not answer in time or refused (operator commands only:
    /// resolve and ensure treat it as a miss).
    RemoteUnavailable => Storage, "remote.unavailable";
    /// A remote record (ref, manifest, chunk, lease) fails verification.
    RemoteRecordInvalid => Storage, "remote.record_invalid";
    /// The remote has no record for the key.
    RemoteAbsent => Storage, "remote.absent";
    /// A conditional remote write lost (the record moved meanwhile).
    RemoteConflict => Storage, "remote.conflict";
    /// A remote listing could not be completed (more names than the cap, or
    /// a page claiming more without a continuation token): nothing that
    /// depends on it (a `fleet gc` sweep) was done.
    RemoteListingIncomplete => Storage, "remote.listing_incomplete";

    QuarantinePresent => Quarantined, "quarantine.present";
    QuarantineExportVerification => Quarantined, "quarantine.export_verification";
    QuarantineConcurrent => Quarantined, "quarantine.concurrent";
    QuarantineStoreVerification => Quarantined, "quarantine.store_verification";
    QuarantineArtifactVerification => Quarantined, "quarantine.artifact_verification";
    QuarantineKeyMismatch => Quarantined, "quarantine.key_mismatch";

    AdmissionHostMachine => Admission, "admission.host_machine";
    AdmissionHostFeatures => Admission, "admission.host_features";
    AdmissionHostUnreadable => Admission, "admission.host_unreadable";
    AdmissionHostIsaMissing => Admission, "admission.host_isa_missing";
    AdmissionRequestInvalid => Admission, "admission.request_invalid";
    AdmissionTargetMismatch => Admission, "admission.target_mismatch";
    AdmissionToolchainMismatch => Admission, "admission.toolchain_mismatch";
    AdmissionRecipeKeyMismatch => Admission, "admission.recipe_key_mismatch";
    AdmissionProgramMutated => Admission, "admission.program_mutated";
    AdmissionPlanMismatch => Admission, "admission.plan_mismatch";
    AdmissionLiteralUnbound => Admission, "admission.literal_unbound";
    AdmissionLiteralSerialize => Admission, "admission.literal_serialize";

    /// No signature accompanies an artifact the trust policy must admit.
    TrustUnsigned => Trust, "trust.unsigned";
    /// The signer is not in `allowed_signers`, or not for the statement's producer.
    TrustUntrustedSigner => Trust, "trust.untrusted_signer";
    /// A signature does not verify over its statement, or the statement is malformed.
    TrustBadSignature => Trust, "trust.bad_signature";
    /// The signature's namespace is not `torch-compiled-graphs`, or the signer's line excludes it.
    TrustNamespace => Trust, "trust.namespace";
    /// The signer's validity window excludes now or the signing time.
    TrustExpired => Trust, "trust.expired";
    /// The signer's key is revoked.
    TrustRevoked => Trust, "trust.revoked";
    /// A valid signature of a statement about another artifact.
    TrustStatementMismatch => Trust, "trust.statement_mismatch";
    /// The `allowed_signers` or revoked-keys file cannot be parsed.
    TrustAllowedSignersInvalid => Trust, "trust.allowed_signers_invalid";
    /// `allowed_signers` has a `cert-authority` line.
    TrustCertAuthorityUnsupported => Trust, "trust.cert_authority_unsupported";
    /// A signatures document (`.sig` file or stored record) is malformed.
    TrustSignaturesInvalid => Trust, "trust.signatures_invalid";
    /// The signing key file cannot be used.
    TrustSigningKeyInvalid => Trust, "trust.signing_key_invalid";

    /// A constant the graph needs is not in the weights.
    RunConstantMissing => Binding, "run.constant_missing";
    /// The weights hold a name the graph has no constant for.
    RunConstantUnexpected => Binding, "run.constant_unexpected";
    /// A constant's dtype or shape differs from the recorded row.
    RunConstantMismatch => Binding, "run.constant_mismatch";
    /// A constant is on another device than the graph runs on.
    RunDeviceMismatch => Binding, "run.device_mismatch";
    /// The weights are not a module or a mapping of names to tensors.
    RunWeightsInvalid => Binding, "run.weights_invalid";
    /// The weights do not fit the memory of the device (or host) the graph runs on.
    RunWeightsTooLarge => Binding, "run.weights_too_large";
    /// The unpacked package does not match its metadata or cannot be loaded.
    RunPackageInvalid => Binding, "run.package_invalid";
    /// The literal payload is missing or unreadable.
    RunLiteralPayload => Binding, "run.literal_payload";
    /// A call's arguments do not fit the graph's call convention.
    RunCallInvalid => Binding, "run.call_invalid";
    /// No libtorch was found where the native load path looked for it, or it cannot be opened.
    RunTorchNotFound => Binding, "run.torch_not_found";
    /// The installed torch is not the one that compiled the artifact, or another libtorch is loaded.
    RunTorchMismatch => Binding, "run.torch_mismatch";
    /// The native load path cannot run this artifact (a CUDA target, an unsupported call structure).
    RunNativeUnsupported => Binding, "run.native_unsupported";
    /// torch's package loader cannot load this artifact safely (its `.so` carries its own C++ runtime).
    RunLoaderUnsupported => Binding, "run.loader_unsupported";
    /// An input's dtype, rank or dimensions do not fit what the graph was compiled for.
    RunInputMismatch => Binding, "run.input_mismatch";
    /// An input's memory is not a C-contiguous, aligned buffer the graph can read in place.
    RunInputLayout => Binding, "run.input_layout";
    /// The compiled graph reported a failure while it ran.
    RunExecutionFailed => Binding, "run.execution_failed";
    /// A call or output spec names a pytree type torch cannot rebuild in this process
    /// (its module is not importable) and that is not an output record read by field name.
    RunSpecUnsupported => Binding, "run.spec_unsupported";
    /// A bound tensor was replaced out of place since binding: the graph would read
    /// the old one, so calls are refused until it is bound again.
    RunWeightsStale => Binding, "run.weights_stale";
    /// A LoRA whose format, targets or shapes do not fit the weights set it is fused into.
    RunLoraInvalid => Binding, "run.lora_invalid";
    /// A load option (an argument or its environment variable) has a value outside its domain.
    RunOptionInvalid => Binding, "run.option_invalid";

    IoDestinationOccupied => Io, "io.destination_occupied";
    IoDestinationNotDirectory => Io, "io.destination_not_directory";
    IoError => Io, "io.error";
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error of `tcg-core`: a kind, a stable code, a message and, for I/O
/// errors, the operating system's errno.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: Kind,
    code: Code,
    message: String,
    errno: Option<i32>,
}

/// The result type of `tcg-core`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `code`, with the code's default kind.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Error {
            kind: code.default_kind(),
            code,
            message: message.into(),
            errno: None,
        }
    }

    /// An error of `code` raised as `kind` (for codes whose kind depends on
    /// the operation, such as `cj.*`).
    pub fn with_kind(kind: Kind, code: Code, message: impl Into<String>) -> Self {
        Error {
            kind,
            code,
            message: message.into(),
            errno: None,
        }
    }

    /// A trust-layer error with the same code (`io.error` keeps its errno).
    pub fn from_trust(err: tcg_trust::TrustError) -> Self {
        if let tcg_trust::TrustError::Io { source, .. } = &err {
            return Error::io_code(Code::IoError, source.raw_os_error(), err.to_string());
        }
        let code = Code::from_str_code(err.code()).expect("every trust code is a core code");
        Error::new(code, err.to_string())
    }

    /// A CJ refusal raised in the context of an operation of `kind`.
    pub fn from_cj(kind: Kind, err: &tcg_cj::CjError) -> Self {
        let code = match err.code {
            tcg_cj::CjErrorCode::NonFinite => Code::CjNonFinite,
            tcg_cj::CjErrorCode::IntegerRange => Code::CjIntegerRange,
            tcg_cj::CjErrorCode::InvalidValue => Code::CjInvalidValue,
        };
        Error::with_kind(kind, code, err.to_string())
    }

    /// An I/O error (`io.error`) that keeps the errno, with `context` such as
    /// the operation and path prefixed to the message.
    pub fn io(context: impl fmt::Display, err: &std::io::Error) -> Self {
        Error {
            kind: Kind::Io,
            code: Code::IoError,
            message: format!("{context}: {err}"),
            // An allocation refused by a library (try_reserve) carries no
            // errno; it is still ENOMEM, and never evidence about bytes.
            errno: err
                .raw_os_error()
                .or((err.kind() == std::io::ErrorKind::OutOfMemory).then_some(libc::ENOMEM)),
        }
    }

    /// An I/O error of a specific `io.*` code with an errno.
    pub fn io_code(code: Code, errno: Option<i32>, message: impl Into<String>) -> Self {
        Error {
            kind: Kind::Io,
            code,
            message: message.into(),
            errno,
        }
    }

    /// The kind.
    pub fn kind(&self) -> Kind {
        self.kind
    }
    /// The stable code.
    pub fn code(&self) -> Code {
        self.code
    }
    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// The errno of an I/O error.
    pub fn errno(&self) -> Option<i32> {
        self.errno
    }

    /// The same error with `prefix: ` before its message.
    pub fn context(mut self, prefix: impl fmt::Display) -> Self {
        self.message = format!("{prefix}: {}", self.message);
        self
    }

    /// The same failure re-raised as another kind and code, keeping the message
    /// (for wrapping rules such as "graph_class declaration is invalid: …").
    pub fn rewrap(self, code: Code, prefix: impl fmt::Display) -> Self {
        Error {
            kind: code.default_kind(),
            code,
            message: format!("{prefix}: {}", self.message),
            errno: self.errno,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_trust_code_is_a_core_code_of_kind_trust() {
        let path = std::path::PathBuf::from("f");
        let io = || std::io::Error::from_raw_os_error(2);
        let all = [
            tcg_trust::TrustError::Unsigned(String::new()),
            tcg_trust::TrustError::UntrustedSigner(String::new()),
            tcg_trust::TrustError::BadSignature(String::new()),
            tcg_trust::TrustError::Namespace(String::new()),
            tcg_trust::TrustError::Expired(String::new()),
            tcg_trust::TrustError::Revoked(String::new()),
            tcg_trust::TrustError::StatementMismatch(String::new()),
            tcg_trust::TrustError::AllowedSignersInvalid {
                path: path.clone(),
                line: 1,
                message: String::new(),
            },
            tcg_trust::TrustError::CertAuthorityUnsupported {
                path: path.clone(),
                line: 1,
            },
            tcg_trust::TrustError::SignaturesInvalid(String::new()),
            tcg_trust::TrustError::SigningKeyInvalid(String::new()),
        ];
        for e in all {
            let code = e.code();
            let core = Error::from_trust(e);
            assert_eq!(core.code().as_str(), code);
            assert_eq!(core.kind(), Kind::Trust);
        }
        let core = Error::from_trust(tcg_trust::TrustError::Io { path, source: io() });
        assert_eq!((core.code(), core.errno()), (Code::IoError, Some(2)));
    }

    /// The codes of store hardening (issue 13), bounded packages and signed
    /// provenance (issue 15), pinned by string and kind: renaming one
    /// breaks users who match on it.
    #[test]
    fn hardening_and_trust_codes_are_pinned() {
        let pinned = [
            ("artifact.inflation_ratio", Kind::Artifact),
            ("artifact.package_too_many_entries", Kind::Artifact),
            ("artifact.package_member_too_large", Kind::Artifact),
            ("store.insecure_permissions", Kind::Storage),
            ("store.not_found", Kind::Storage),
            ("store.destination_in_store", Kind::Storage),
            ("trust.unsigned", Kind::Trust),
            ("trust.untrusted_signer", Kind::Trust),
            ("trust.bad_signature", Kind::Trust),
            ("trust.namespace", Kind::Trust),
            ("trust.expired", Kind::Trust),
            ("trust.revoked", Kind::Trust),
            ("trust.statement_mismatch", Kind::Trust),
            ("trust.allowed_signers_invalid", Kind::Trust),
            ("trust.cert_authority_unsupported", Kind::Trust),
            ("trust.signatures_invalid", Kind::Trust),
            ("trust.signing_key_invalid", Kind::Trust),
        ];
        for (s, kind) in pinned {
            let code = Code::from_str_code(s).unwrap_or_else(|| panic!("{s} is not a code"));
            assert_eq!(Error::new(code, "x").kind(), kind, "{s}");
        }
    }

    /// The store's hardening errors keep their own codes through the
    /// engine, which maps store errors by code string (an unknown string
    /// would fall back to `store.ref_invalid`).
    #[test]
    fn store_hardening_errors_keep_their_codes_in_the_engine() {
        let p = std::path::PathBuf::from("p");
        let all = [
            tcg_cas::StoreError::InsecurePermissions {
                path: p.clone(),
                reason: String::new(),
            },
            tcg_cas::StoreError::NotFound {
                path: p.clone(),
                reason: String::new(),
            },
        ];
        for e in all {
            let code = Code::from_str_code(e.code()).unwrap_or_else(|| panic!("{}", e.code()));
            assert_eq!(crate::engine::store_err(e).code(), code);
        }
    }

    #[test]
    fn codes_are_unique_well_formed_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for code in Code::ALL {
            let s = code.as_str();
            assert!(seen.insert(s), "duplicate {s}");
            let (area, slug) = s.split_once('.').unwrap();
            assert!(!area.is_empty() && !slug.is_empty());
            assert!(
                slug.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{s}"
            );
            assert_eq!(Code::from_str_code(s), Some(*code));
        }
    }
}

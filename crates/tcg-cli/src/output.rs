use std::io::{self, Write};

use tcg_core::{Error, Kind};

/// What a command concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0.
    Success,
    /// Exit 1: an expected negative answer.
    Negative,
}

impl Outcome {
    /// The process exit code.
    pub fn exit_code(self) -> i32 {
        match self {
            Outcome::Success => 0,
            Outcome::Negative => 1,
        }
    }
}

/// Write `text` and a newline to stdout. A closed pipe ends the output quietly.
pub fn print_line(text: &str) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    match writeln!(out, "{text}").and_then(|_| out.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

/// Print an error (and a hint where one helps) to stderr; return the exit code.
pub fn report_error(err: &anyhow::Error) -> i32 {
    let core = err.chain().find_map(|e| e.downcast_ref::<Error>());
    let mut stderr = io::stderr().lock();
    // Messages embed untrusted strings (names from artifacts, old stores,
    // remotes): one escaped line, so nothing can forge another `error:` line
    // or drive the terminal.
    let _ = writeln!(
        stderr,
        "error: {}",
        tcg_core::text::message(&format!("{err:#}"))
    );
    if let Some(core) = core {
        let _ = writeln!(stderr, "code: {}", core.code());
        if let Some(hint) = hint(core) {
            let _ = writeln!(stderr, "hint: {hint}");
        }
        use tcg_core::Code::{
            TrustAllowedSignersInvalid, TrustCertAuthorityUnsupported, TrustSigningKeyInvalid,
        };
        // A trust file or key that cannot be used is a usage error, not a verdict.
        if matches!(
            core.code(),
            TrustAllowedSignersInvalid | TrustCertAuthorityUnsupported | TrustSigningKeyInvalid
        ) {
            return 2;
        }
        return match core.kind() {
            Kind::Artifact
            | Kind::Admission
            | Kind::Quarantined
            | Kind::Identity
            | Kind::Declaration
            | Kind::Trust => 1,
            Kind::Compile | Kind::Storage | Kind::Binding | Kind::Io => 2,
        };
    }
    2
}

fn hint(err: &Error) -> Option<&'static str> {
    use tcg_core::Code::*;
    match err.code() {
        ArtifactBarePt2 => {
            Some("wrap the package in a compiled_graph.tar.gz envelope by minting or exporting it")
        }
        IdentityAxisIsKey => {
            Some("pass the class hash, the sm and the toolchain axis, not a whole key")
        }
        StoreHashrepoRoot => Some(
            "the old root stays as it is: adopt copies and verifies every graph into the new root",
        ),
        TrustUnsigned => Some("export the artifact from a store that signed it (ENVELOPE.sig beside it), or sign it with `sign`"),
        TrustUntrustedSigner => Some("add the signer's public key and principal (the statement's producer) to the allowed_signers file"),
        TrustCertAuthorityUnsupported => Some("list the signing keys themselves in allowed_signers"),
        DeclarationToolchainInvalid => {
            Some("a toolchain block is a JSON object of non-empty trimmed strings")
        }
        StoreNotFound => Some(
            "check --cas-root (or XDG_CACHE_HOME); a store is created by import, ensure or gc, \
             never by ls, stats, fsck or resolve",
        ),
        StoreInsecurePermissions => Some(
            "the store must be writable by its owner only: chown it to yourself and run chmod -R go-w on it",
        ),
        StoreDestinationInStore => Some("choose a destination outside the store root"),
        StoreAdoptOverlap => Some(
            "choose a --cas-root outside the old root (and not above it), e.g. a sibling directory",
        ),
        StoreGcAborted => Some("run fsck --quarantine to move unreadable ref records aside"),
        _ => None,
    }
}

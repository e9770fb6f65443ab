//! Quarantine markers and their retirement (SPEC-v1 §9.5, §10.5).

use std::io::Read;

use tcg_cas::{CasOutcome, Digest, Lease, Target};
use tcg_cj::{Map, Value};

use super::{quarantine_ref, store_err, Engine};
use crate::{Code, Error, Result};

/// 16 bytes from the operating system's CSPRNG, in hex.
pub(crate) fn random_hex32() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Error::io("cannot read /dev/urandom", &e))?;
    Ok(hex::encode(bytes))
}

/// CJ bytes of a quarantine marker (wire identity).
pub(crate) fn marker_bytes(key: &str, manifest: &Digest, marker: &str) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("format".into(), Value::Int(1));
    m.insert("key".into(), key.into());
    m.insert("manifest".into(), manifest.to_prefixed().into());
    m.insert("marker".into(), marker.into());
    tcg_cj::to_canonical(&Value::Object(m)).expect("a marker is plain strings")
}

impl Engine {
    /// The current quarantine marker of (key, manifest), if any.
    pub(crate) fn quarantine_marker(&self, key: &str, manifest: &Digest) -> Result<Option<Target>> {
        self.store
            .get_ref(&quarantine_ref(key, manifest))
            .map_err(store_err)
    }

    /// Quarantine (key, manifest) with a new marker generation. Never deletes
    /// bytes and never moves the graph ref.
    pub(crate) fn quarantine(
        &self,
        lease: &Lease,
        key: &str,
        manifest: &Digest,
        event: Code,
    ) -> Result<()> {
        self.install_marker(lease, key, manifest)?;
        self.count(super::Counter::Quarantine);
        eprintln!(
            "torch-compiled-graphs: quarantined {key} manifest {} ({event})",
            manifest.to_hex()
        );
        Ok(())
    }

    /// Set a divergent candidate aside (SPEC-v1 §10.4): it gets a quarantine
    /// marker so that it is never served, but nothing failed verification and
    /// the record that serves the key is unchanged, which is what the log says.
    pub(crate) fn set_aside_divergent(
        &self,
        lease: &Lease,
        key: &str,
        candidate: &Digest,
        incumbent: &Digest,
    ) -> Result<()> {
        self.install_marker(lease, key, candidate)?;
        // Its marker is still a quarantine marker, so stats count it as one.
        self.count(super::Counter::Quarantine);
        eprintln!(
            "torch-compiled-graphs: {key} is already served by a different verified artifact \
             (manifest {}); the divergent candidate (manifest {}) was set aside and the stored \
             record is unchanged",
            incumbent.to_hex(),
            candidate.to_hex()
        );
        Ok(())
    }

    /// Install a new marker generation for (key, manifest).
    fn install_marker(&self, lease: &Lease, key: &str, manifest: &Digest) -> Result<()> {
        let name = quarantine_ref(key, manifest);
        loop {
            let old = self.store.get_ref(&name).map_err(store_err)?;
            let bytes = marker_bytes(key, manifest, &random_hex32()?);
            let marker = self.store.put_bytes(lease, &bytes).map_err(store_err)?;
            let desired = Target::object(marker);
            match self
                .store
                .compare_and_swap(&name, old.as_ref(), Some(&desired))
                .map_err(store_err)?
            {
                CasOutcome::Matched | CasOutcome::AlreadyEqual => break,
                CasOutcome::Conflict(_) => continue,
            }
        }
        Ok(())
    }

    /// Retire an observed marker: only that generation is removed. A newer
    /// generation is `quarantine.concurrent`, so a stale repair can never clear
    /// a fresh quarantine.
    pub(crate) fn retire(&self, key: &str, manifest: &Digest, observed: &Target) -> Result<()> {
        let name = quarantine_ref(key, manifest);
        match self
            .store
            .compare_and_swap(&name, Some(observed), None)
            .map_err(store_err)?
        {
            CasOutcome::Matched | CasOutcome::AlreadyEqual => Ok(()),
            CasOutcome::Conflict(_) => Err(Error::new(
                Code::QuarantineConcurrent,
                format!("received a fresh quarantine during repair of {key}"),
            )),
        }
    }
}

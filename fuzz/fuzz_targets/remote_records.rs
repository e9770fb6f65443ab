//! The parsers of the fleet tier's remote records over arbitrary bytes: the
//! first byte picks one, the rest is its input. Ref and lease records, a
//! manifest through every check the remote applies before the first GET
//! (named by its own SHA-256, so that the parser runs), a signature record's
//! name and bytes (statement parse and verify), and a listing page through
//! the HTTP guard's rewrite. None may panic; what each accepts must
//! round-trip or re-parse to the same result.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcg_cas::Digest;
use tcg_remote::{Layout, LeaseRecord, RefRecord};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    match pick % 5 {
        0 => {
            if let Ok(r) = RefRecord::parse(rest) {
                assert_eq!(r.to_bytes(), rest);
                assert_eq!(RefRecord::parse(&r.to_bytes()).unwrap(), r);
            }
        }
        1 => {
            if let Some(l) = LeaseRecord::parse(rest) {
                assert!((1..=86_400).contains(&l.ttl_s));
                assert!(LeaseRecord::parse(&l.to_bytes()).is_some());
            }
        }
        2 => {
            let named = Digest::of(rest);
            if let Ok(Some(m)) = tcg_remote::fetch::check_manifest(rest, &named) {
                assert_eq!(m.to_bytes(), rest);
                assert!(m.size <= tcg_core::artifact::MAX_ARCHIVE_BYTES);
            }
            // Named otherwise: always refused.
            assert!(tcg_remote::fetch::check_manifest(rest, &Digest([7; 32])).is_err() || named == Digest([7; 32]));
        }
        3 => {
            // A listed name (the first line) and a record (the rest).
            let (name, record) = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (rest, &[][..]),
            };
            let layout = Layout::new("fleet");
            if let Ok(name) = std::str::from_utf8(name) {
                if let Ok(path) = object_store::path::Path::parse(name) {
                    if let Some((key, fp, m, r)) = tcg_remote::signatures::parse_name(&layout, &path) {
                        assert!(tcg_core::engine::check_key(&key).is_ok());
                        assert_eq!(fp.len(), 64);
                        let _ = (m, r);
                    }
                }
            }
            if let Ok(s) = tcg_trust::SignedStatement::parse(record) {
                let _ = s.verify();
            }
        }
        _ => {
            if let Ok(page) = tcg_remote::guard::clean_page(rest) {
                // The rewrite is itself a clean page, unchanged by another pass.
                assert_eq!(tcg_remote::guard::clean_page(&page).unwrap(), page);
            }
        }
    }
});

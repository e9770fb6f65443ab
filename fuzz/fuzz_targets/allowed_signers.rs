//! `allowed_signers` text through the OpenSSH-compatible parser (tcg-trust):
//! never a panic; parsing is deterministic; each accepted line keeps its
//! patterns within OpenSSH's bounds; and matching the principals and
//! namespaces of every accepted line against a name taken from the input
//! terminates quickly (the matcher is iterative), agreeing with a negation
//! veto.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tcg_trust::{match_pattern_list, parse_time, AllowedSigners};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("allowed_signers");
    let first = AllowedSigners::parse(path, text);
    let again = AllowedSigners::parse(path, text);
    match (&first, &again) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a.signers.len(), b.signers.len());
            assert_eq!(a.digest, b.digest);
        }
        (Err(a), Err(b)) => assert_eq!(a.code(), b.code()),
        _ => panic!("parsing is not deterministic"),
    }
    // A name to match: the input's last line (any producer a statement may claim).
    let name = text.lines().last().unwrap_or("");
    if let Ok(allowed) = first {
        for s in &allowed.signers {
            assert!(!s.principals.is_empty());
            let m = match_pattern_list(name, &s.principals);
            if m {
                // A match means no negated subpattern matched.
                for p in s.principals.split(',') {
                    if let Some(neg) = p.strip_prefix('!').filter(|n| !n.starts_with('!')) {
                        assert!(!match_pattern_list(name, neg), "a negated pattern matched");
                    }
                }
            }
            if let Some(ns) = &s.namespaces {
                let _ = match_pattern_list("torch-compiled-graphs", ns);
                let _ = match_pattern_list(name, ns);
            }
            if let (Some(a), Some(b)) = (s.valid_after, s.valid_before) {
                let _ = a <= b;
            }
        }
    }
    for word in text.split([' ', '"', ',', '=']).take(64) {
        let _ = parse_time(word);
    }
});

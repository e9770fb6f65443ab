//! Interop with the real OpenSSH `ssh-keygen`: it verifies our signatures, we
//! verify its signatures, and its verdict agrees with our policy on every
//! refusal `allowed_signers` can express.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tcg_trust::{
    document_bytes, parse_document, AllowedSigners, RevokedKeys, SignedStatement, Signer,
    Statement, Subject, TrustPolicy, NAMESPACE,
};

fn ssh_keygen() -> &'static str {
    // CI installs openssh-client (Makefile `deps`); a missing tool is a failure, not a skip.
    assert!(
        Command::new("ssh-keygen")
            .arg("-?")
            .stderr(Stdio::null())
            .status()
            .is_ok(),
        "ssh-keygen is required (apt-get install openssh-client)"
    );
    "ssh-keygen"
}

struct Key {
    private: PathBuf,
    public: String,
}

fn keygen(dir: &Path, name: &str, comment: &str) -> Key {
    let private = dir.join(name);
    let st = Command::new(ssh_keygen())
        .args(["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"])
        .arg(&private)
        .status()
        .unwrap();
    assert!(st.success());
    let public = std::fs::read_to_string(private.with_extension("pub"))
        .unwrap_or_else(|_| std::fs::read_to_string(format!("{}.pub", private.display())).unwrap());
    Key {
        private,
        public: public.trim().to_string(),
    }
}

fn subject() -> Subject {
    Subject {
        key: format!("cg-key-v1-{}", "1".repeat(56)),
        envelope_sha256: "2".repeat(64),
        toolchain: "3".repeat(16),
    }
}

fn other_subject() -> Subject {
    Subject {
        envelope_sha256: "4".repeat(64),
        ..subject()
    }
}

/// `ssh-keygen -Y verify` of `entry` for `principal`; true when it accepts.
fn openssh_verifies(
    dir: &Path,
    allowed: &str,
    principal: &str,
    entry: &SignedStatement,
    revoked: Option<&str>,
) -> bool {
    let a = dir.join("allowed_signers.check");
    std::fs::write(&a, allowed).unwrap();
    let s = dir.join("entry.sig");
    std::fs::write(&s, &entry.sshsig).unwrap();
    let mut cmd = Command::new(ssh_keygen());
    cmd.args(["-Y", "verify", "-n", NAMESPACE, "-I", principal, "-f"])
        .arg(&a)
        .arg("-s")
        .arg(&s);
    if let Some(r) = revoked {
        let rp = dir.join("revoked.check");
        std::fs::write(&rp, r).unwrap();
        cmd.arg("-r").arg(rp);
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(entry.statement.as_bytes())
        .unwrap();
    child.wait().unwrap().success()
}

/// Sign `statement` with the real `ssh-keygen -Y sign`.
fn openssh_sign(dir: &Path, key: &Key, namespace: &str, statement: &Statement) -> SignedStatement {
    let msg = dir.join("statement.json");
    std::fs::write(&msg, statement.to_bytes()).unwrap();
    let _ = std::fs::remove_file(dir.join("statement.json.sig"));
    let st = Command::new(ssh_keygen())
        .args(["-q", "-Y", "sign", "-n", namespace, "-f"])
        .arg(&key.private)
        .arg(&msg)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    SignedStatement {
        statement: String::from_utf8(statement.to_bytes()).unwrap(),
        sshsig: std::fs::read_to_string(dir.join("statement.json.sig")).unwrap(),
    }
}

fn policy(dir: &Path, allowed: &str, revoked: Option<&str>) -> TrustPolicy {
    let p = dir.join("allowed_signers");
    std::fs::write(&p, allowed).unwrap();
    let revoked = revoked.map(|r| {
        let rp = dir.join("revoked");
        std::fs::write(&rp, r).unwrap();
        RevokedKeys::load(&rp).unwrap()
    });
    TrustPolicy::new(
        AllowedSigners::load(&p).unwrap(),
        revoked.unwrap_or_default(),
    )
}

fn now() -> i64 {
    tcg_trust::unix_now()
}

#[test]
fn ssh_keygen_verifies_our_signature_and_we_verify_its() {
    let dir = tempfile::tempdir().unwrap();
    let key = keygen(dir.path(), "ci", "ci@a.example");
    let allowed = format!("ci@a.example {}\n", key.public);
    let p = policy(dir.path(), &allowed, None);

    // Ours, checked by OpenSSH.
    let signer = Signer::from_file(&key.private).unwrap();
    let ours = signer
        .sign(&signer.statement(&subject(), "ci@a.example", now()))
        .unwrap();
    assert!(openssh_verifies(
        dir.path(),
        &allowed,
        "ci@a.example",
        &ours,
        None
    ));
    assert!(p
        .admit(std::slice::from_ref(&ours), &subject(), now())
        .is_ok());

    // OpenSSH's, checked by us.
    let theirs = openssh_sign(
        dir.path(),
        &key,
        NAMESPACE,
        &signer.statement(&subject(), "ci@a.example", now()),
    );
    let admitted = p
        .admit(std::slice::from_ref(&theirs), &subject(), now())
        .unwrap();
    assert_eq!(admitted.line, 1);
    assert_eq!(admitted.signature.statement.producer, "ci@a.example");

    // Both travel in one signatures document.
    let doc = document_bytes(&[ours.clone(), theirs.clone()]);
    assert_eq!(parse_document(&doc).unwrap(), vec![ours, theirs]);
}

/// (policy text, revoked keys, entry, principal, expected code, whether OpenSSH refuses too)
type Case<'a> = (
    String,
    Option<String>,
    SignedStatement,
    &'a str,
    &'a str,
    bool,
);

#[test]
fn every_refusal_has_its_code_and_openssh_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let a = keygen(dir.path(), "a", "a@x");
    let b = keygen(dir.path(), "b", "b@x");
    let sa = Signer::from_file(&a.private).unwrap();
    let sb = Signer::from_file(&b.private).unwrap();
    let t = now();
    let good = sa.sign(&sa.statement(&subject(), "a@x", t)).unwrap();
    let line = |opts: &str| format!("a@x {opts} {}\n", a.public);

    let mut tampered = good.clone();
    tampered.statement = tampered.statement.replace(&"2".repeat(64), &"5".repeat(64));
    let by_b = sb.sign(&sb.statement(&subject(), "a@x", t)).unwrap();
    let other_ns = openssh_sign(dir.path(), &a, "file", &sa.statement(&subject(), "a@x", t));
    let for_other = sa.sign(&sa.statement(&other_subject(), "a@x", t)).unwrap();
    let wrong_principal = sa.sign(&sa.statement(&subject(), "mallory@x", t)).unwrap();
    let mut swapped_signer = sa.statement(&subject(), "a@x", t);
    swapped_signer.signer = tcg_trust::openssh_public(sb.public_key());
    let swapped = sa.sign(&swapped_signer).unwrap();
    let cases: Vec<Case<'_>> = vec![
        (line(""), None, tampered, "a@x", "trust.bad_signature", true),
        (line(""), None, by_b, "a@x", "trust.untrusted_signer", true),
        (line(""), None, other_ns, "a@x", "trust.namespace", true),
        (
            line("namespaces=\"git,file\""),
            None,
            good.clone(),
            "a@x",
            "trust.namespace",
            true,
        ),
        (
            line("valid-before=\"20200101Z\""),
            None,
            good.clone(),
            "a@x",
            "trust.expired",
            true,
        ),
        (
            line("valid-after=\"29990101Z\""),
            None,
            good.clone(),
            "a@x",
            "trust.expired",
            true,
        ),
        (
            line(""),
            Some(format!("{}\n", a.public)),
            good.clone(),
            "a@x",
            "trust.revoked",
            true,
        ),
        (
            line(""),
            None,
            for_other,
            "a@x",
            "trust.statement_mismatch",
            false,
        ),
        (
            line(""),
            None,
            wrong_principal,
            "mallory@x",
            "trust.untrusted_signer",
            true,
        ),
        (line(""), None, swapped, "a@x", "trust.bad_signature", false),
    ];
    for (allowed, revoked, entry, principal, code, openssh_refuses) in cases {
        let p = policy(dir.path(), &allowed, revoked.as_deref());
        let err = p
            .admit(std::slice::from_ref(&entry), &subject(), t)
            .unwrap_err();
        assert_eq!(err.code(), code, "{allowed}: {err}");
        assert!(err.is_refusal());
        if openssh_refuses {
            assert!(
                !openssh_verifies(dir.path(), &allowed, principal, &entry, revoked.as_deref()),
                "ssh-keygen accepted what we refuse as {code}"
            );
        }
    }
    // The unrestricted line accepts the good signature, for both verifiers.
    let p = policy(dir.path(), &line(""), None);
    assert!(p.admit(std::slice::from_ref(&good), &subject(), t).is_ok());
    assert!(openssh_verifies(dir.path(), &line(""), "a@x", &good, None));
    // No signature at all.
    assert_eq!(
        p.admit(&[], &subject(), t).unwrap_err().code(),
        "trust.unsigned"
    );
    // One good signature among bad ones admits.
    let mut junk = good.clone();
    junk.sshsig = "-----BEGIN SSH SIGNATURE-----\nAAAA\n-----END SSH SIGNATURE-----\n".into();
    assert!(p.admit(&[junk, good], &subject(), t).is_ok());
}

#[test]
fn signing_keys_that_cannot_sign_unattended_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let k = keygen(dir.path(), "k", "k@x");
    std::fs::set_permissions(&k.private, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        Signer::from_file(&k.private).unwrap_err().code(),
        "trust.signing_key_invalid"
    );
    let enc = dir.path().join("enc");
    assert!(Command::new(ssh_keygen())
        .args(["-q", "-t", "ed25519", "-N", "secret", "-f"])
        .arg(&enc)
        .status()
        .unwrap()
        .success());
    assert_eq!(
        Signer::from_file(&enc).unwrap_err().code(),
        "trust.signing_key_invalid"
    );
    let rsa = dir.path().join("rsa");
    assert!(Command::new(ssh_keygen())
        .args(["-q", "-t", "rsa", "-b", "2048", "-N", "", "-f"])
        .arg(&rsa)
        .status()
        .unwrap()
        .success());
    assert_eq!(
        Signer::from_file(&rsa).unwrap_err().code(),
        "trust.signing_key_invalid"
    );
}

#[test]
fn signatures_documents_are_strict() {
    for bad in [
        &b""[..],
        b"{}\n",
        b"{\"format\":1,\"signatures\":[],\"type\":\"torch-compiled-graphs.signatures\"}",
        b"{\"format\":2,\"signatures\":[],\"type\":\"torch-compiled-graphs.signatures\"}\n",
        b"{\"format\":1,\"signatures\":[{\"sshsig\":1,\"statement\":\"\"}],\"type\":\"torch-compiled-graphs.signatures\"}\n",
        b"{\"format\":1, \"signatures\":[],\"type\":\"torch-compiled-graphs.signatures\"}\n",
    ] {
        assert_eq!(parse_document(bad).unwrap_err().code(), "trust.signatures_invalid");
    }
    let many = vec![
        SignedStatement {
            statement: "s".into(),
            sshsig: "x".into()
        };
        tcg_trust::MAX_SIGNATURES + 1
    ];
    assert_eq!(
        parse_document(&document_bytes(&many)).unwrap_err().code(),
        "trust.signatures_invalid"
    );
}

/// Issue 25: `allowed_signers` lines mean what `ssh-keygen -Y verify` makes
/// of them. Each line is tried with a good signature by its key for its
/// principal, by our parser and policy and by the real `ssh-keygen`: both
/// accept, or both refuse. The documented exceptions (a time without `Z`,
/// read in local time by OpenSSH) are refused by us only, never the reverse.
#[test]
fn allowed_signers_lines_are_read_exactly_as_ssh_keygen_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let a = keygen(dir.path(), "a", "a@x");
    let sa = Signer::from_file(&a.private).unwrap();
    let t = now();
    let good = sa.sign(&sa.statement(&subject(), "a@x", t)).unwrap();
    let k = &a.public;
    let long = "p".repeat(1100);
    let accepted: Vec<String> = vec![
        format!("a@x {k}"),
        format!("\"a@x\" {k}"),
        format!("\"b@y,a@x\" {k}"),
        format!("a\"@x\" {k}"),
        format!("  a@x\t{k}"),
        format!("*@x {k} \"a comment\" with words"),
        format!("a@x namespaces=\"torch-compiled-graphs\" {k}"),
        format!("a@x NAMESPACES=\"git,torch-*\" {k}"),
        format!("a@x namespaces=\"torch compiled graphs,torch-compiled-graphs\" {k}"),
        format!("a@x namespaces=\"a\\\"b,torch-compiled-graphs\" {k}"),
        format!("a@x valid-after=\"20200101Z\",valid-before=\"29990101Z\" {k}"),
        format!("a@x Valid-After=\"202001011200Z\" {k}"),
        format!("a@x namespaces=\"torch-compiled-graphs\",,valid-after=\"20200101Z\" {k}"),
        format!("b@y {k}\na@x {k}"),
    ];
    let refused: Vec<String> = vec![
        // Repeated options.
        format!("a@x namespaces=\"torch-compiled-graphs\",namespaces=\"git\" {k}"),
        format!("a@x valid-after=\"20200101Z\",valid-after=\"20210101Z\" {k}"),
        format!("a@x valid-before=\"29990101Z\",VALID-BEFORE=\"29980101Z\" {k}"),
        // Unquoted values, with and without spaces.
        format!("a@x namespaces=torch-compiled-graphs {k}"),
        format!("a@x namespaces=torch compiled graphs,torch-compiled-graphs {k}"),
        format!("a@x valid-before=29990101Z {k}"),
        // Over-long patterns (OpenSSH matches nothing with them).
        format!("{long},a@x {k}"),
        format!("a@x namespaces=\"{long},torch-compiled-graphs\" {k}"),
        // Malformed options and keys.
        format!("a@x frobnicate {k}"),
        format!("a@x namespaces=\"torch-compiled-graphs\", {k}"),
        format!("a@x namespaces=\"torch-compiled-graphs {k}"),
        format!("a@x namespaces=\"torch-compiled-graphs\"x {k}"),
        format!("a@x namespaces=\"torch-compiled-graphs\" valid-after=\"20200101Z\" {k}"),
        format!("a@x valid-after=\"19700101Z\" {k}"),
        format!("a@x valid-after=\"2020010Z\" {k}"),
        format!("a@x ssh-foo {k}"),
        format!("a@x cert-authority {k}"),
        format!("\"a@x {k}"),
        "a@x ssh-ed25519".to_string(),
        "a@x".to_string(),
    ];
    let stricter: Vec<String> = vec![format!("a@x valid-after=\"20200101\" {k}")];
    let ours = |line: &str| -> bool {
        let p = dir.path().join("allowed_signers");
        std::fs::write(&p, format!("{line}\n")).unwrap();
        match AllowedSigners::load(&p) {
            Ok(allowed) => TrustPolicy::new(allowed, RevokedKeys::default())
                .admit(std::slice::from_ref(&good), &subject(), t)
                .is_ok(),
            Err(e) => {
                assert!(
                    matches!(
                        e.code(),
                        "trust.allowed_signers_invalid" | "trust.cert_authority_unsupported"
                    ),
                    "{line}: {e}"
                );
                false
            }
        }
    };
    let theirs =
        |line: &str| openssh_verifies(dir.path(), &format!("{line}\n"), "a@x", &good, None);
    for line in &accepted {
        assert!(theirs(line), "ssh-keygen refuses {line:?}");
        assert!(ours(line), "we refuse {line:?}, which ssh-keygen accepts");
    }
    for line in &refused {
        assert!(!theirs(line), "ssh-keygen accepts {line:?}");
        assert!(!ours(line), "we accept {line:?}, which ssh-keygen refuses");
    }
    for line in &stricter {
        assert!(theirs(line), "ssh-keygen refuses {line:?}");
        assert!(!ours(line), "we accept {line:?} (documented as refused)");
    }
}

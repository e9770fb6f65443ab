//! The remote records are wire identity (FLEET.md §1, §4): exact bytes, and a
//! strict reader.

use tcg_cas::Digest;
use tcg_remote::{Layout, LeaseRecord, RefRecord, RemoteConfig};

const KEY: &str = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd363a";

fn record() -> RefRecord {
    RefRecord {
        key: KEY.into(),
        manifest: Digest::of(b"m"),
        producer: "p".into(),
        created: 7,
    }
}

#[test]
fn the_ref_record_has_pinned_bytes_and_round_trips() {
    let bytes = record().to_bytes();
    let want = format!(
        r#"{{"created":7,"format":1,"key":"{KEY}","manifest":"sha256:{}","producer":"p"}}"#,
        Digest::of(b"m").to_hex()
    );
    assert_eq!(String::from_utf8(bytes.clone()).unwrap(), want);
    assert_eq!(RefRecord::parse(&bytes).unwrap(), record());
}

#[test]
fn the_ref_reader_refuses_every_other_shape() {
    let good = String::from_utf8(record().to_bytes()).unwrap();
    let cases = [
        good.replace(r#""format":1"#, r#""format":2"#),
        good.replace(r#""created":7,"#, ""),
        good.replace(r#""producer":"p""#, r#""producer":"p","x":1"#),
        good.replace("sha256:", "md5:"),
        good.replace(r#""created":7"#, r#""created":"7""#),
        good.replace(',', ", "),
        format!("{good}\n"),
        "[]".into(),
        "not json".into(),
    ];
    for bad in cases {
        assert!(RefRecord::parse(bad.as_bytes()).is_err(), "{bad}");
    }
}

#[test]
fn the_lease_record_has_pinned_bytes() {
    let l = LeaseRecord {
        holder: "ab".repeat(16),
        host: "h".into(),
        ttl_s: 60,
    };
    assert_eq!(
        String::from_utf8(l.to_bytes()).unwrap(),
        format!(
            r#"{{"format":1,"holder":"{}","host":"h","ttl_s":60}}"#,
            "ab".repeat(16)
        )
    );
    assert_eq!(LeaseRecord::parse(&l.to_bytes()), Some(l));
    assert_eq!(LeaseRecord::parse(b"{}"), None);
}

#[test]
fn layout_names_follow_the_prefix() {
    let d = Digest::of(b"x");
    let h = d.to_hex();
    assert_eq!(
        Layout::new("").graph_ref(KEY).to_string(),
        format!("tcg/v1/refs/{KEY}")
    );
    assert_eq!(
        Layout::new("/a/b/").lease(KEY).to_string(),
        format!("a/b/tcg/v1/leases/{KEY}")
    );
    assert_eq!(
        Layout::new("p").chunk(&d).to_string(),
        format!("p/tcg/v1/chunks/sha256/{}/{h}", &h[..2])
    );
    assert_eq!(
        Layout::new("p").report(KEY, &h, "r").to_string(),
        format!("p/tcg/v1/reports/{KEY}/{h}/r")
    );
}

#[test]
fn config_urls_and_bounds_are_checked() {
    assert!(RemoteConfig::new("s3://bucket/prefix").is_ok());
    for bad in ["http://x", "bucket/prefix", "s3://b/p?x=1", ""] {
        let e = RemoteConfig::new(bad).unwrap_err();
        assert_eq!(e.code().as_str(), "remote.config_invalid", "{bad}");
    }
    let c = RemoteConfig::new("s3://b").unwrap();
    assert_eq!(
        c.data_timeout(4 << 20),
        c.timeout + std::time::Duration::from_secs(1)
    );
}

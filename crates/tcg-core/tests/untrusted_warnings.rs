//! Remote warnings carry server answers, bucket names and listing names:
//! untrusted text (issue 25). Whatever a warning embeds, what reaches the
//! log (the hook the Python layer installs, or stderr) is one escaped,
//! capped line.

use std::sync::Mutex;

static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());

#[test]
fn a_warning_is_one_escaped_capped_line() {
    assert!(tcg_core::engine::set_remote_warn_hook(Box::new(|line| {
        SEEN.lock().unwrap().push(line.to_string())
    })));
    let server = "bucket\u{1b}]8;;http://evil/\u{7}click\u{1b}]8;;\u{7}\r\nerror: forged\u{202e}";
    tcg_core::engine::remote_warn(format_args!(
        "GET s3://{server}/x: 500 {}",
        "B".repeat(10_000)
    ));
    let seen = SEEN.lock().unwrap();
    assert_eq!(seen.len(), 1);
    let line = &seen[0];
    assert!(!line.contains('\n') && !line.contains('\r'), "{line:?}");
    assert!(!line.chars().any(tcg_core::text::is_dangerous), "{line:?}");
    assert!(
        line.contains(
            "bucket\\x1b]8;;http://evil/\\x07click\\x1b]8;;\\x07\\r\\nerror: forged\\u{202e}"
        ),
        "{line}"
    );
    assert!(
        line.chars().count() < tcg_core::text::MAX_MESSAGE_CHARS + 40,
        "{}",
        line.len()
    );
    assert!(line.ends_with("more bytes]"), "{line}");
}

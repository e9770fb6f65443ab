//! The `check_input_` scan of `load_native` over a wrapper built to blow it
//! up (many functions with no boundary between them, each full of
//! conditions): linear work, measured by counting, and bounded peak memory,
//! measured in a child process.

use std::process::Command;

use tcg_run::inputs::{input_facts, input_scan_work};

const CHILD_ENV: &str = "TCG_INPUT_SCAN_CHILD";

fn blow_up(functions: usize) -> String {
    let mut s = String::new();
    for i in 0..functions {
        s.push_str(&format!(
            "static void check_input_{i}( int32_t a_expected_dtype = aoti_torch_dtype_float32(); "
        ));
        for k in 0..8 {
            s.push_str(&format!(
                "if (4 != a_size[{k}]) {{}} if (a_size[{k}] < 2) {{}} "
            ));
        }
    }
    s
}

#[test]
fn child_scan() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let text = blow_up(20_000);
    let facts = input_facts(&text).unwrap().unwrap();
    // SAFETY: getrusage writes one struct this frame owns.
    let rss = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u.ru_maxrss
    };
    println!("FACTS {} BYTES {} RSS {rss}", facts.len(), text.len());
}

#[test]
fn the_scan_of_a_blown_up_wrapper_is_linear_and_bounded() {
    let (small, big) = (blow_up(5_000), blow_up(10_000));
    let (ws, wb) = (input_scan_work(&small), input_scan_work(&big));
    assert!(wb <= 2 * ws + ws / 10, "work {ws} -> {wb}");
    assert!(
        wb <= 8 * big.len() as u64,
        "work {wb} for {} bytes",
        big.len()
    );

    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child_scan", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let at = stdout.find("FACTS ").expect("the child's report");
    let fields: Vec<&str> = stdout[at..].split_whitespace().collect();
    assert_eq!(fields[1], "20000", "{stdout}");
    let rss_kib: i64 = fields[5].parse().unwrap();
    // The text is ~7 MB and the facts a few MB: far under the bound.
    assert!(rss_kib < 256 << 10, "peak RSS {} MiB", rss_kib >> 10);
}

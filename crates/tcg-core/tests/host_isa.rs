//! Host ISA (SPEC-v1 §5): classification, recorded requirement, validation of
//! recorded facts and admission.

use tcg_cj::{Map, Value};
use tcg_core::host_isa::{admit, cumulative_flags, parse_cpuinfo, HostFacts, HostIsa};
use tcg_core::Code;

const V2: &str = "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3";
const V3_ADDS: &str = "abm avx avx2 bmi1 bmi2 f16c fma movbe xsave";
const V4_ADDS: &str = "avx512f avx512bw avx512cd avx512dq avx512vl";
const V3_TEXT: &str =
    "abm,avx,avx2,bmi1,bmi2,cx16,f16c,fma,lahf_lm,movbe,popcnt,sse4_1,sse4_2,ssse3,xsave";

fn cpuinfo(flag_lines: &[&str]) -> Vec<u8> {
    let mut s = String::new();
    for (i, flags) in flag_lines.iter().enumerate() {
        s.push_str(&format!(
            "processor\t: {i}\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 {flags}\n\n"
        ));
    }
    s.into_bytes()
}

fn x86(flags: &str) -> HostFacts {
    HostFacts::from_parts("x86_64", &cpuinfo(&[flags])).unwrap()
}

fn facts(pairs: &[(&str, Value)]) -> Value {
    let mut m = Map::new();
    for (k, v) in pairs {
        m.insert((*k).to_owned(), v.clone());
    }
    Value::Object(m)
}

fn v3_facts() -> Map {
    HostIsa {
        machine: "x86_64".into(),
        host_isa_level: "x86-64-v3".into(),
        host_isa_features: V3_TEXT.into(),
        cpp_march: "x86-64-v3".into(),
        cpp_simdlen: "256".into(),
    }
    .to_map()
}

fn with(mut m: Map, k: &str, v: Value) -> Value {
    m.insert(k.into(), v);
    Value::Object(m)
}

fn invalid(v: &Value) -> Code {
    HostIsa::from_value(v, Code::ArtifactHostIsaInvalid)
        .unwrap_err()
        .code()
}

#[test]
fn a_v1_host_records_x86_64_with_no_features() {
    let host = x86("sse3 cx16 popcnt");
    assert_eq!(host.x86_level(), "x86-64");
    let req = host.requirement().unwrap();
    assert_eq!(req.host_isa_level, "x86-64");
    assert_eq!(req.cpp_march, "x86-64");
    assert_eq!(req.cpp_simdlen, "128");
    assert_eq!(req.host_isa_features, "none");
    assert_eq!(host.cpu_sm().unwrap(), "cpu-x86-64");
    HostIsa::from_value(&req.to_value(), Code::ArtifactHostIsaInvalid).unwrap();
}

#[test]
fn a_v2_host_records_v2() {
    let host = x86(&format!("{V2} avx avx2"));
    let req = host.requirement().unwrap();
    assert_eq!(req.host_isa_level, "x86-64-v2");
    assert_eq!(req.cpp_simdlen, "128");
    assert_eq!(
        req.host_isa_features,
        "cx16,lahf_lm,popcnt,sse4_1,sse4_2,ssse3"
    );
    assert_eq!(host.cpu_sm().unwrap(), "cpu-x86-64-v2");
}

#[test]
fn a_v3_host_records_v3_with_the_spec_feature_string() {
    let host = x86(&format!("{V2} {V3_ADDS}"));
    let req = host.requirement().unwrap();
    assert_eq!(req.host_isa_level, "x86-64-v3");
    assert_eq!(req.cpp_march, "x86-64-v3");
    assert_eq!(req.cpp_simdlen, "256");
    assert_eq!(req.host_isa_features, V3_TEXT);
    assert_eq!(host.cpu_sm().unwrap(), "cpu-x86-64-v3");
}

#[test]
fn a_v4_host_is_clamped_to_v3() {
    let host = x86(&format!("{V2} {V3_ADDS} {V4_ADDS}"));
    assert_eq!(host.x86_level(), "x86-64-v4");
    let req = host.requirement().unwrap();
    assert_eq!(req.host_isa_level, "x86-64-v3");
    assert_eq!(req.host_isa_features, V3_TEXT);
    assert_eq!(host.cpu_sm().unwrap(), "cpu-x86-64-v3");
}

#[test]
fn the_level_walk_stops_at_the_first_failing_level() {
    // v3 flags without v2's: the host is x86-64, not v3.
    let host = x86(V3_ADDS);
    assert_eq!(host.x86_level(), "x86-64");
}

#[test]
fn features_are_the_intersection_over_processors() {
    let text = cpuinfo(&[&format!("{V2} {V3_ADDS}"), V2]);
    let host = HostFacts::from_parts("X86_64\n", &text).unwrap();
    assert_eq!(host.machine(), "x86_64");
    assert_eq!(host.requirement().unwrap().host_isa_level, "x86-64-v2");
}

#[test]
fn cpuinfo_tokens_are_lowercased_and_split_on_the_separator_set() {
    let set = parse_cpuinfo(b"Features\t: FP asimd\x1cAES\x0bcrc32\r\nflags: x").unwrap();
    // Only the `Features` line and the `flags` line count; their intersection is empty.
    assert!(set.is_empty());
    let set = parse_cpuinfo(b" Features \t: FP  asimd\x1cAES\x0bcrc32\xff\n").unwrap();
    let got: Vec<&str> = set.iter().map(String::as_str).collect();
    assert_eq!(got, ["aes", "asimd", "crc32\u{fffd}", "fp"]);
}

#[test]
fn cpuinfo_without_flags_fails_closed() {
    let err = parse_cpuinfo(b"processor: 0\nmodel name: x\n").unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostUnreadable);
    let err = HostFacts::from_parts("  ", b"flags: a").unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostUnreadable);
}

#[test]
fn an_aarch64_host_records_its_whole_feature_set_as_native() {
    let host = HostFacts::from_parts(
        "aarch64",
        b"processor: 0\nFeatures\t: fp asimd evtstrm aes\n",
    )
    .unwrap();
    let req = host.requirement().unwrap();
    assert_eq!(req.machine, "aarch64");
    assert_eq!(req.host_isa_level, "native");
    assert_eq!(req.cpp_march, "native");
    assert_eq!(req.cpp_simdlen, "native");
    assert_eq!(req.host_isa_features, "aes,asimd,evtstrm,fp");
    assert_eq!(host.cpu_sm().unwrap(), "cpu-aarch64-native");
    HostIsa::from_value(&req.to_value(), Code::ArtifactHostIsaInvalid).unwrap();
}

#[test]
fn a_non_x86_host_without_features_cannot_state_a_requirement() {
    let host = HostFacts::from_parts("aarch64", b"Features\t:\n").unwrap();
    let err = host.requirement().unwrap_err();
    assert_eq!(err.code(), Code::DeclarationHostPolicy);
    assert!(err
        .message()
        .contains("cannot state a native ISA requirement"));
}

#[test]
fn cumulative_flags_accumulate() {
    assert!(cumulative_flags("x86-64").unwrap().is_empty());
    assert_eq!(cumulative_flags("x86-64-v3").unwrap().len(), 15);
    assert_eq!(cumulative_flags("x86-64-v4").unwrap().len(), 20);
    assert!(cumulative_flags("x86-64-v5").is_none());
}

#[test]
fn validation_accepts_the_recorded_v3_facts() {
    let f = HostIsa::from_value(&Value::Object(v3_facts()), Code::ArtifactHostIsaInvalid).unwrap();
    assert_eq!(f.feature_set().len(), 15);
}

#[test]
fn validation_refuses_extra_missing_and_non_string_members() {
    assert_eq!(
        invalid(&with(v3_facts(), "extra", "x".into())),
        Code::ArtifactHostIsaInvalid
    );
    let mut m = v3_facts();
    m.remove("cpp_simdlen");
    assert_eq!(invalid(&Value::Object(m)), Code::ArtifactHostIsaInvalid);
    assert_eq!(
        invalid(&with(v3_facts(), "cpp_simdlen", Value::Int(256))),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(invalid(&Value::Null), Code::ArtifactHostIsaInvalid);
    // The code is the caller's.
    let err = HostIsa::from_value(&Value::Null, Code::DeclarationHostPolicy).unwrap_err();
    assert_eq!(err.code(), Code::DeclarationHostPolicy);
    assert!(err.message().starts_with("host_isa facts are invalid: "));
}

#[test]
fn validation_refuses_v4_and_unknown_levels() {
    let v4_features = cumulative_flags("x86-64-v4")
        .unwrap()
        .into_iter()
        .collect::<Vec<_>>()
        .join(",");
    let v4 = facts(&[
        ("machine", "x86_64".into()),
        ("host_isa_level", "x86-64-v4".into()),
        ("host_isa_features", Value::Str(v4_features)),
        ("cpp_march", "x86-64-v4".into()),
        ("cpp_simdlen", "512".into()),
    ]);
    assert_eq!(invalid(&v4), Code::ArtifactHostIsaInvalid);
    assert_eq!(
        invalid(&with(v3_facts(), "host_isa_level", "x86-64-v9".into())),
        Code::ArtifactHostIsaInvalid
    );
}

#[test]
fn validation_refuses_march_and_simdlen_mismatches() {
    assert_eq!(
        invalid(&with(v3_facts(), "cpp_march", "x86-64-v2".into())),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(
        invalid(&with(v3_facts(), "cpp_simdlen", "128".into())),
        Code::ArtifactHostIsaInvalid
    );
    let mut native = v3_facts();
    native.insert("machine".into(), "aarch64".into());
    native.insert("host_isa_level".into(), "native".into());
    native.insert("cpp_march".into(), "native".into());
    assert_eq!(
        invalid(&Value::Object(native.clone())),
        Code::ArtifactHostIsaInvalid
    ); // simdlen 256
    native.insert("cpp_simdlen".into(), "native".into());
    HostIsa::from_value(&Value::Object(native.clone()), Code::ArtifactHostIsaInvalid).unwrap();
    assert_eq!(
        invalid(&with(native, "host_isa_features", "none".into())),
        Code::ArtifactHostIsaInvalid
    );
}

#[test]
fn validation_refuses_features_that_do_not_restate_the_level() {
    let short = V3_TEXT.replace(",xsave", "");
    assert_eq!(
        invalid(&with(v3_facts(), "host_isa_features", Value::Str(short))),
        Code::ArtifactHostIsaInvalid
    );
    let more = format!("{V3_TEXT},zzz");
    assert_eq!(
        invalid(&with(v3_facts(), "host_isa_features", Value::Str(more))),
        Code::ArtifactHostIsaInvalid
    );
    let mut v1 = v3_facts();
    v1.insert("host_isa_level".into(), "x86-64".into());
    v1.insert("cpp_march".into(), "x86-64".into());
    v1.insert("cpp_simdlen".into(), "128".into());
    assert_eq!(
        invalid(&with(v1.clone(), "host_isa_features", "".into())),
        Code::ArtifactHostIsaInvalid
    );
    HostIsa::from_value(
        &with(v1, "host_isa_features", "none".into()),
        Code::ArtifactHostIsaInvalid,
    )
    .unwrap();
}

#[test]
fn validation_refuses_unsorted_uppercase_or_untrimmed_features_and_machine() {
    let unsorted = V3_TEXT.replacen("abm,avx", "avx,abm", 1);
    assert_eq!(
        invalid(&with(v3_facts(), "host_isa_features", Value::Str(unsorted))),
        Code::ArtifactHostIsaInvalid
    );
    let upper = V3_TEXT.replace("avx2", "AVX2");
    assert_eq!(
        invalid(&with(v3_facts(), "host_isa_features", Value::Str(upper))),
        Code::ArtifactHostIsaInvalid
    );
    let dup = V3_TEXT.replace("abm,", "abm,abm,");
    assert_eq!(
        invalid(&with(v3_facts(), "host_isa_features", Value::Str(dup))),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(
        invalid(&with(v3_facts(), "machine", "X86_64".into())),
        Code::ArtifactHostIsaInvalid
    );
    assert_eq!(
        invalid(&with(v3_facts(), "machine", " x86_64".into())),
        Code::ArtifactHostIsaInvalid
    );
}

#[test]
fn admission_refuses_a_machine_mismatch() {
    let host = HostFacts::from_parts("aarch64", b"Features: fp asimd").unwrap();
    let err = admit(Some(&Value::Object(v3_facts())), &host).unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostMachine);
    assert_eq!(
        err.message(),
        "artifact host ISA is unsupported: artifact host code is x86_64, this host is aarch64"
    );
}

#[test]
fn admission_refuses_a_feature_shortfall_and_names_the_missing_flags() {
    let host = x86(&format!("{V2} abm avx bmi1 bmi2 f16c movbe xsave"));
    let err = admit(Some(&Value::Object(v3_facts())), &host).unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostFeatures);
    assert_eq!(
        err.message(),
        "artifact host ISA is unsupported: artifact requires x86-64-v3 but this host lacks avx2,fma"
    );
}

#[test]
fn admission_accepts_a_capable_host_and_refuses_missing_facts() {
    let host = x86(&format!("{V2} {V3_ADDS} {V4_ADDS}"));
    admit(Some(&Value::Object(v3_facts())), &host).unwrap();
    let err = admit(None, &host).unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostIsaMissing);
    let err = admit(Some(&with(v3_facts(), "x", "y".into())), &host).unwrap_err();
    assert_eq!(err.code(), Code::AdmissionHostIsaMissing);
    assert!(err
        .message()
        .starts_with("artifact host ISA is unsupported: host_isa facts are invalid"));
}

#[test]
fn this_host_is_readable_on_linux() {
    let host = HostFacts::read().expect("this Linux host is readable");
    assert!(!host.machine().is_empty());
    let req = host.requirement().unwrap();
    HostIsa::from_value(&req.to_value(), Code::ArtifactHostIsaInvalid).unwrap();
    // A host always admits its own requirement.
    admit(Some(&req.to_value()), &host).unwrap();
}

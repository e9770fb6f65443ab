//! Unit tests of `lora`: hand-built safetensors files (no torch), checked
//! against a set described by names, dtypes and shapes.

use std::collections::HashMap;

use safetensors::tensor::{serialize, TensorView};
use safetensors::Dtype as St;

use super::*;

/// A tensor to write: name, dtype, shape, bytes.
type Spec = (String, St, Vec<usize>, Vec<u8>);

fn f32s(shape: &[usize], fill: f32) -> Vec<u8> {
    let n: usize = shape.iter().product();
    (0..n)
        .flat_map(|i| (fill + i as f32 * 0.25).to_le_bytes())
        .collect()
}

fn pair(module: &str, rank: usize, out: usize, rest: &[usize]) -> Vec<Spec> {
    let mut down = vec![rank];
    down.extend_from_slice(rest);
    let mut up = vec![out, rank];
    if rest.len() > 1 {
        up.extend([1, 1]);
    }
    vec![
        (
            format!("{module}.lora_A.weight"),
            St::F32,
            down.clone(),
            f32s(&down, 1.0),
        ),
        (
            format!("{module}.lora_B.weight"),
            St::F32,
            up.clone(),
            f32s(&up, -1.0),
        ),
    ]
}

fn alpha(module: &str, value: f32) -> Spec {
    (
        format!("{module}.alpha"),
        St::F32,
        vec![],
        value.to_le_bytes().to_vec(),
    )
}

fn write(dir: &Path, file: &str, specs: &[Spec], meta: Option<&str>) -> PathBuf {
    let views: Vec<(String, TensorView<'_>)> = specs
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let info = meta.map(|m| HashMap::from([("lora_adapter_metadata".to_owned(), m.to_owned())]));
    let bytes = serialize(views, info).unwrap();
    let path = dir.join(file);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The set of the tests: a linear layer `l1` (32 x 16), a conv `conv_in`
/// (8 x 4 x 3 x 3), a half-precision `l2` (16 x 16) and an integer table.
fn set(name: &str) -> Option<(bool, Vec<i64>)> {
    match name {
        "l1.weight" => Some((true, vec![32, 16])),
        "conv_in.weight" => Some((true, vec![8, 4, 3, 3])),
        "l2.weight" => Some((true, vec![16, 16])),
        "table.weight" => Some((false, vec![10, 4])),
        _ => None,
    }
}

fn plan_file(path: &Path, scale: f64, prefix: Option<&str>) -> Result<Vec<Target>> {
    plan(&read(path)?, &set, scale, prefix)
}

fn refused(result: Result<Vec<Target>>) -> String {
    let err = result.expect_err("refused");
    assert_eq!(err.code(), Code::RunLoraInvalid, "{}", err.message());
    err.message().to_owned()
}

fn scales(targets: &[Target]) -> Vec<(&str, f64)> {
    targets
        .iter()
        .map(|t| (t.weight.as_str(), t.scale))
        .collect()
}

#[test]
fn a_diffusers_component_prefix_and_peft_prefix_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let specs: Vec<Spec> = pair("unet.l1", 4, 32, &[16])
        .into_iter()
        .chain(pair("unet.conv_in", 2, 8, &[4, 3, 3]))
        .collect();
    let targets = plan_file(&write(dir.path(), "a.safetensors", &specs, None), 1.0, None).unwrap();
    assert_eq!(
        scales(&targets),
        [("conv_in.weight", 1.0), ("l1.weight", 1.0)]
    );
    let peft: Vec<Spec> = pair("base_model.model.l1", 4, 32, &[16]);
    let targets = plan_file(&write(dir.path(), "b.safetensors", &peft, None), 2.5, None).unwrap();
    assert_eq!(scales(&targets), [("l1.weight", 2.5)]);
    assert_eq!(targets[0].rank, 4);
    assert_eq!(targets[0].matrix(), (32, 16));
}

#[test]
fn a_conv_lora_is_a_matrix_over_the_flattened_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "c.safetensors",
        &pair("conv_in", 3, 8, &[4, 3, 3]),
        None,
    );
    let targets = plan_file(&path, 1.0, None).unwrap();
    assert_eq!(targets[0].matrix(), (8, 36));
    assert_eq!(targets[0].down.shape, [3, 4, 3, 3]);
    assert_eq!(targets[0].up.shape, [8, 3, 1, 1]);
}

#[test]
fn a_directory_is_read_through_its_diffusers_or_peft_file() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "adapter_model.safetensors",
        &pair("l1", 2, 32, &[16]),
        None,
    );
    assert_eq!(
        scales(&plan_file(dir.path(), 1.0, None).unwrap()),
        [("l1.weight", 1.0)]
    );
    // diffusers' name is preferred when both are there.
    write(
        dir.path(),
        "pytorch_lora_weights.safetensors",
        &pair("l2", 2, 16, &[16]),
        None,
    );
    assert_eq!(
        scales(&plan_file(dir.path(), 1.0, None).unwrap()),
        [("l2.weight", 1.0)]
    );
    let empty = tempfile::tempdir().unwrap();
    assert!(refused(plan_file(empty.path(), 1.0, None)).contains("holds none of"));
}

#[test]
fn alpha_comes_from_the_tensor_then_the_header_then_adapter_config() {
    let dir = tempfile::tempdir().unwrap();
    // The module's .alpha tensor: alpha / rank x scale.
    let mut specs = pair("l1", 4, 32, &[16]);
    specs.push(alpha("l1", 6.0));
    let path = write(dir.path(), "t.safetensors", &specs, None);
    assert_eq!(
        scales(&plan_file(&path, 0.5, None).unwrap()),
        [("l1.weight", 0.75)]
    );
    // A half-precision alpha reads as its value.
    let mut specs = pair("l1", 4, 32, &[16]);
    specs.push((
        "l1.alpha".into(),
        St::F16,
        vec![1],
        0x4600u16.to_le_bytes().to_vec(),
    ));
    let path = write(dir.path(), "h.safetensors", &specs, None);
    assert_eq!(
        scales(&plan_file(&path, 1.0, None).unwrap()),
        [("l1.weight", 1.5)]
    );
    // diffusers' packed metadata, per component; the tensor wins over it.
    let specs: Vec<Spec> = pair("unet.l1", 4, 32, &[16])
        .into_iter()
        .chain(pair("unet.l2", 2, 16, &[16]))
        .chain([alpha("unet.l2", 1.0)])
        .collect();
    let meta = r#"{"unet.r": 4, "unet.lora_alpha": 8, "text_encoder.lora_alpha": 100}"#;
    let path = write(dir.path(), "m.safetensors", &specs, Some(meta));
    assert_eq!(
        scales(&plan_file(&path, 1.0, None).unwrap()),
        [("l1.weight", 2.0), ("l2.weight", 0.5)]
    );
    // PEFT's adapter_config.json beside the file, with alpha_pattern and rslora.
    let peft = tempfile::tempdir().unwrap();
    let specs: Vec<Spec> = pair("base_model.model.l1", 4, 32, &[16])
        .into_iter()
        .chain(pair("base_model.model.l2", 4, 16, &[16]))
        .collect();
    write(peft.path(), "adapter_model.safetensors", &specs, None);
    std::fs::write(
        peft.path().join("adapter_config.json"),
        r#"{"r": 4, "lora_alpha": 8, "alpha_pattern": {"l[2]": 2}, "use_rslora": true}"#,
    )
    .unwrap();
    assert_eq!(
        scales(&plan_file(peft.path(), 1.0, None).unwrap()),
        [("l1.weight", 4.0), ("l2.weight", 1.0)]
    );
    // The header's metadata is preferred over adapter_config.json.
    write(
        peft.path(),
        "adapter_model.safetensors",
        &specs,
        Some(r#"{"lora_alpha": 2}"#),
    );
    assert_eq!(
        scales(&plan_file(peft.path(), 1.0, None).unwrap()),
        [("l1.weight", 0.5), ("l2.weight", 0.5)]
    );
    // No alpha anywhere: 1 x scale.
    let path = write(dir.path(), "n.safetensors", &pair("l1", 4, 32, &[16]), None);
    assert_eq!(
        scales(&plan_file(&path, 3.0, None).unwrap()),
        [("l1.weight", 3.0)]
    );
}

#[test]
fn an_alpha_pattern_matches_a_whole_name_or_its_last_parts() {
    let config: Map<String, Value> = serde_json::from_str(
        r#"{"lora_alpha": 1, "alpha_pattern": {"attn.to_q": 5, "down.*proj": 7}}"#,
    )
    .unwrap();
    assert_eq!(
        config_alpha(&config, "blocks.0.attn.to_q").unwrap(),
        Some(5.0)
    );
    assert_eq!(config_alpha(&config, "attn.to_q").unwrap(), Some(5.0));
    assert_eq!(config_alpha(&config, "xattn.to_q").unwrap(), Some(1.0));
    assert_eq!(
        config_alpha(&config, "blocks.attn.to_qk").unwrap(),
        Some(1.0)
    );
    assert_eq!(
        config_alpha(&config, "down_blocks.1.proj").unwrap(),
        Some(7.0)
    );
    let bad: Map<String, Value> = serde_json::from_str(r#"{"alpha_pattern": {"(": 5}}"#).unwrap();
    assert_eq!(
        config_alpha(&bad, "x").unwrap_err().code(),
        Code::RunLoraInvalid
    );
}

#[test]
fn several_components_need_a_prefix_and_the_prefix_selects_one() {
    let dir = tempfile::tempdir().unwrap();
    let specs: Vec<Spec> = pair("unet.l1", 4, 32, &[16])
        .into_iter()
        .chain(pair("text_encoder.q", 2, 8, &[8]))
        .collect();
    let path = write(
        dir.path(),
        "p.safetensors",
        &specs,
        Some(r#"{"unet.lora_alpha": 2}"#),
    );
    let message = refused(plan_file(&path, 1.0, None));
    assert!(
        message.contains("several components (text_encoder., unet.)"),
        "{message}"
    );
    assert_eq!(
        scales(&plan_file(&path, 1.0, Some("unet.")).unwrap()),
        [("l1.weight", 0.5)]
    );
    assert!(refused(plan_file(&path, 1.0, Some("prior."))).contains("no names under"));
}

#[test]
fn every_misfit_is_refused_with_every_reason() {
    let dir = tempfile::tempdir().unwrap();
    let good = pair("l1", 4, 32, &[16]);
    let cases: Vec<(Vec<Spec>, &str)> = vec![
        // The delta's shape differs from the weight's.
        (
            pair("l1", 4, 9, &[16]),
            "the LoRA changes a [9, 16] weight, l1.weight is [32, 16]",
        ),
        // A module the set does not have.
        (
            pair("mid.nothing", 4, 8, &[8]),
            "the weights set has no \"mid.nothing.weight\"",
        ),
        // Ranks that disagree.
        (
            vec![
                good[0].clone(),
                (
                    "l1.lora_B.weight".into(),
                    St::F32,
                    vec![32, 3],
                    f32s(&[32, 3], 0.0),
                ),
            ],
            "lora_A has rank 4, lora_B has 3",
        ),
        // A missing half.
        (
            vec![good[0].clone()],
            "lora_A and lora_B must both be present",
        ),
        (
            vec![alpha("l1", 1.0)],
            "lora_A and lora_B must both be present",
        ),
        // lora_B that is not out x rank (x 1 x 1).
        (
            vec![
                (
                    "conv_in.lora_A.weight".into(),
                    St::F32,
                    vec![2, 4, 3, 3],
                    f32s(&[2, 4, 3, 3], 0.0),
                ),
                (
                    "conv_in.lora_B.weight".into(),
                    St::F32,
                    vec![8, 2, 3, 3],
                    f32s(&[8, 2, 3, 3], 0.0),
                ),
            ],
            "are not a LoRA pair",
        ),
        // Names that are not LoRA weights.
        (
            good.iter()
                .cloned()
                .chain([("l1.weight".into(), St::F32, vec![1], f32s(&[1], 0.0))])
                .collect(),
            "names that are not LoRA weights: [\"l1.weight\"]",
        ),
        // Not floating point: the LoRA, or the weight.
        (
            vec![
                (
                    "l1.lora_A.weight".into(),
                    St::I32,
                    vec![4, 16],
                    vec![0; 256],
                ),
                good[1].clone(),
            ],
            "LoRA and weight must be floating point",
        ),
        (
            pair("table", 2, 10, &[4]),
            "LoRA and weight must be floating point",
        ),
        // An alpha that is no number, or that makes the scale infinite.
        (
            good.iter()
                .cloned()
                .chain([("l1.alpha".into(), St::F32, vec![0], vec![])])
                .collect(),
            "holds no number",
        ),
        (
            vec![
                ("l1.lora_A.weight".into(), St::F32, vec![0, 16], vec![]),
                ("l1.lora_B.weight".into(), St::F32, vec![32, 0], vec![]),
                alpha("l1", 1.0),
            ],
            "is not a finite number",
        ),
    ];
    for (i, (specs, reason)) in cases.iter().enumerate() {
        let path = write(dir.path(), &format!("bad{i}.safetensors"), specs, None);
        let message = refused(plan_file(&path, 1.0, None));
        assert!(message.contains(reason), "case {i}: {message}");
    }
    // Several misfits: every reason in one refusal.
    let specs: Vec<Spec> = pair("l1", 4, 9, &[16])
        .into_iter()
        .chain(pair("mid.nothing", 4, 8, &[8]))
        .collect();
    let message = refused(plan_file(
        &write(dir.path(), "two.safetensors", &specs, None),
        1.0,
        None,
    ));
    assert!(
        message.contains("l1.weight is") && message.contains("mid.nothing.weight"),
        "{message}"
    );
    // A non-finite scale, and a file with no tensors.
    let path = write(dir.path(), "ok.safetensors", &good, None);
    for scale in [f64::NAN, f64::INFINITY] {
        assert!(refused(plan_file(&path, scale, None)).contains("finite"));
    }
    let empty = write(dir.path(), "empty.safetensors", &[], None);
    assert!(refused(plan_file(&empty, 1.0, None)).contains("holds no tensors"));
}

#[test]
fn malformed_files_and_configs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = pair("l1", 4, 32, &[16]);
    let path = write(dir.path(), "ok.safetensors", &good, None);
    // Truncated, or not a safetensors file at all.
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
    assert!(refused(plan_file(&cut, 1.0, None)).contains("truncated"));
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"\xff\xff\xff\xff\xff\xff\xff\xffnot a header").unwrap();
    refused(plan_file(&junk, 1.0, None));
    assert!(refused(plan_file(
        &dir.path().join("missing.safetensors"),
        1.0,
        None
    ))
    .contains("cannot"));
    // Not a regular file: a FIFO is refused without waiting for a writer.
    let fifo = dir.path().join("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a path in a private temporary directory.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert!(refused(plan_file(&fifo, 1.0, None)).contains("regular file"));
    // Malformed metadata in the header, and a config that is not an object.
    let path = write(dir.path(), "m.safetensors", &good, Some("{not json"));
    assert!(refused(plan_file(&path, 1.0, None)).contains("malformed lora_adapter_metadata"));
    let path = write(dir.path(), "l.safetensors", &good, Some("[1, 2]"));
    assert!(refused(plan_file(&path, 1.0, None)).contains("not an object"));
    let peft = tempfile::tempdir().unwrap();
    write(peft.path(), "adapter_model.safetensors", &good, None);
    std::fs::write(peft.path().join("adapter_config.json"), "{oops").unwrap();
    assert!(refused(plan_file(peft.path(), 1.0, None)).contains("adapter_config.json"));
    std::fs::write(peft.path().join("adapter_config.json"), "3").unwrap();
    assert!(refused(plan_file(peft.path(), 1.0, None)).contains("not an object"));
}

#[test]
fn half_and_brain_float_scalars_read_as_their_values() {
    let t = |dtype: &str, bytes: Vec<u8>| HostTensor {
        dtype: dtype.into(),
        shape: vec![],
        bytes,
    };
    assert_eq!(
        t("float16", 0x3c00u16.to_le_bytes().to_vec()).first_value(),
        Some(1.0)
    );
    assert_eq!(
        t("float16", 0x0001u16.to_le_bytes().to_vec()).first_value(),
        Some(2f64.powi(-24))
    );
    assert_eq!(
        t("float16", 0xc100u16.to_le_bytes().to_vec()).first_value(),
        Some(-2.5)
    );
    assert_eq!(
        t("bfloat16", 0x4040u16.to_le_bytes().to_vec()).first_value(),
        Some(3.0)
    );
    assert_eq!(
        t("int64", 7i64.to_le_bytes().to_vec()).first_value(),
        Some(7.0)
    );
    assert_eq!(t("float32", vec![]).first_value(), None);
}

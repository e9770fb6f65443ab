//! The versioned sets of libtorch C shim functions that a libtorch-free
//! runtime implements, and the test of a package's imports against one
//! (issue 34; docs/shim.md).
//!
//! The runtime is `libtcg_shim.so` (crates/tcg-shim, chosen by
//! [`crate::runtime`]); this module is the contract it is held to. `shim set v1` is data, `shim_set_v1.txt` beside this
//! file (one name a line, sorted, `#` comments); it never changes once
//! released, and a larger set is a new version.
//!
//! A package is judged from what its `.so` imports
//! ([`tcg_core::artifact::package::shim_imports`]): every `aoti_torch_*`
//! import must be in the set, and no other import may remain outside the
//! system libraries (an `other` import, such as a libtorch C++ API symbol,
//! is something no shim provides).

use tcg_core::artifact::package::shim_imports::ShimImports;

/// The text of `shim set v1` (`shim_set_v1.txt`).
pub const SHIM_SET_V1_TEXT: &str = include_str!("shim_set_v1.txt");

/// The name of the set [`shim_set_v1`] returns, as docs and reports print it.
pub const SHIM_SET_V1: &str = "shim set v1";

/// The functions of `shim set v1`, in the file's (sorted) order.
pub fn shim_set_v1() -> Vec<&'static str> {
    SHIM_SET_V1_TEXT
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// Whether `shim set v1` provides every symbol in `imports`: `Ok(())`, or
/// the symbols it lacks, sorted and distinct. Pass the `aoti_torch` imports
/// of a package together with its `other` imports (which no shim set
/// holds), or use [`package_covered`].
pub fn shim_set_covers<S: AsRef<str>>(imports: &[S]) -> Result<(), Vec<String>> {
    let set = shim_set_v1();
    let mut missing: Vec<String> = imports
        .iter()
        .map(AsRef::as_ref)
        .filter(|name| set.binary_search(name).is_err())
        .map(str::to_owned)
        .collect();
    missing.sort_unstable();
    missing.dedup();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(missing)
    }
}

/// [`shim_set_covers`] for a package's imports: its `aoti_torch` and its
/// `other` imports together.
pub fn package_covered(imports: &ShimImports) -> Result<(), Vec<String>> {
    let all: Vec<&str> = imports
        .aoti_torch
        .iter()
        .chain(&imports.other)
        .map(String::as_str)
        .collect();
    shim_set_covers(&all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_is_sorted_distinct_and_only_shim_functions() {
        let set = shim_set_v1();
        let mut sorted = set.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(set, sorted);
        assert_eq!(set.len(), 44);
        for name in &set {
            assert!(name.starts_with("aoti_torch_"), "{name}");
            assert!(
                !name.starts_with("aoti_torch_cpu_") && !name.starts_with("aoti_torch_cuda_")
                    || *name == "aoti_torch_cuda_guard_set_index",
                "{name} is op-specific"
            );
        }
        // The header comment says what the file is.
        assert!(SHIM_SET_V1_TEXT.starts_with("# shim set v1"));
    }

    #[test]
    fn a_covered_import_list_passes_and_every_miss_is_named_once() {
        assert_eq!(shim_set_covers::<&str>(&[]), Ok(()));
        assert_eq!(
            shim_set_covers(&[
                "aoti_torch_empty_strided",
                "aoti_torch_get_current_cuda_stream"
            ]),
            Ok(())
        );
        assert_eq!(
            shim_set_covers(&[
                "aoti_torch_cuda_mm_out",
                "aoti_torch_clone",
                "aoti_torch_cuda_mm_out",
                "aoti_torch_cpu_addmm_out",
            ]),
            Err(vec![
                "aoti_torch_cpu_addmm_out".to_owned(),
                "aoti_torch_cuda_mm_out".to_owned()
            ])
        );
        // Near misses are misses: exact names only.
        assert_eq!(
            shim_set_covers(&["aoti_torch_clone ", "AOTI_TORCH_CLONE", "aoti_torch_"]),
            Err(vec![
                "AOTI_TORCH_CLONE".to_owned(),
                "aoti_torch_".to_owned(),
                "aoti_torch_clone ".to_owned()
            ])
        );
    }

    #[test]
    fn a_package_is_covered_only_with_no_other_import() {
        let mut imports = ShimImports {
            aoti_torch: vec!["aoti_torch_clone".into(), "aoti_torch_get_sizes".into()],
            other: vec![],
        };
        assert_eq!(package_covered(&imports), Ok(()));
        imports
            .other
            .push("_ZN3c106detail14torchCheckFailEPKcS2_jS2_".into());
        assert_eq!(
            package_covered(&imports),
            Err(vec!["_ZN3c106detail14torchCheckFailEPKcS2_jS2_".to_owned()])
        );
    }
}

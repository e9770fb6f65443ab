//! Member names and size limits of the envelope (SPEC-v1 §1.3, §6.1, §6.5).
//! Limits are inclusive.

/// The metadata member, always first.
pub const METADATA_MEMBER: &str = "metadata.json";
/// The AOTInductor package member, always second.
pub const PACKAGE_MEMBER: &str = "model.pt2";
/// The literal payload member, third and present iff there are literal rows.
pub const LITERALS_MEMBER: &str = "constants.safetensors";
/// The file name of an envelope.
pub const ENVELOPE_FILE_NAME: &str = "compiled_graph.tar.gz";

/// Largest `metadata.json` (8 MiB).
pub const MAX_METADATA_BYTES: u64 = 8_388_608;
/// Largest `model.pt2` (8 GiB − 1: the largest 11-digit octal size).
pub const MAX_PACKAGE_BYTES: u64 = 8_589_934_591;
/// Largest `constants.safetensors` (4 GiB).
pub const MAX_LITERALS_BYTES: u64 = 4_294_967_296;
/// Largest sum of the three members.
pub const MAX_MEMBER_BYTES: u64 = MAX_METADATA_BYTES + MAX_PACKAGE_BYTES + MAX_LITERALS_BYTES;
/// Largest decompressed tar stream.
pub const MAX_TAR_BYTES: u64 = MAX_MEMBER_BYTES + 20_480;
/// Largest compressed envelope file.
pub const MAX_ARCHIVE_BYTES: u64 = MAX_MEMBER_BYTES + MAX_MEMBER_BYTES / 100 + 10_240;
/// Largest safetensors header of the literal payload (8 MiB).
pub const MAX_SAFETENSORS_HEADER_BYTES: u64 = 8_388_608;

// Resource bounds of the verifiers (project additions to SPEC-v1 §6.5; see
// docs/FORMAT.md "Resource bounds"). Every verifier's memory is bounded by
// these constants and its time is linear in the bytes it reads.

/// Bytes any stream may inflate to before the ratio cap applies (64 MiB).
pub const INFLATION_ALLOWANCE_BYTES: u64 = 64 << 20;
/// Largest ratio of inflated to compressed bytes past the allowance: the
/// envelope's decompressed tar stream may hold at most
/// `INFLATION_ALLOWANCE_BYTES + MAX_INFLATION_RATIO × compressed bytes read`
/// (`artifact.inflation_ratio`), and so may the package members the verifier
/// reads, against their stored (compressed) sizes.
pub const MAX_INFLATION_RATIO: u64 = 64;
/// Most entries a package zip may list (`artifact.package_too_many_entries`).
pub const MAX_PACKAGE_ENTRIES: u64 = 65_535;
/// Most bytes the zip reader may read while opening a package (the central
/// directory and the end records), which bounds the entries it parses
/// whichever end record it settles on (16 MiB).
pub const MAX_CENTRAL_DIRECTORY_BYTES: u64 = 16 << 20;
/// Largest `*.wrapper.cpp` member, held in memory to scan (64 MiB).
pub const MAX_WRAPPER_BYTES: u64 = 64 << 20;
/// Largest `*.cubin` member, held in memory to check (64 MiB).
pub const MAX_CUBIN_BYTES: u64 = 64 << 20;

/// The most inflated bytes allowed after `compressed` bytes of input.
pub fn inflation_cap(compressed: u64) -> u64 {
    INFLATION_ALLOWANCE_BYTES.saturating_add(MAX_INFLATION_RATIO.saturating_mul(compressed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_have_the_spec_values() {
        assert_eq!(MAX_MEMBER_BYTES, 12_893_290_495);
        assert_eq!(MAX_TAR_BYTES, 12_893_310_975);
        assert_eq!(MAX_ARCHIVE_BYTES, 13_022_233_639);
    }
}

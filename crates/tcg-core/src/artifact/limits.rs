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

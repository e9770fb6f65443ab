//! The USTAR subset of the envelope (SPEC-v1 §6.2, §6.6 steps 5–6): the one
//! header shape the writer emits, and its exact check on read.

use crate::error::{Code, Error, Result};

/// Tar block size.
pub const BLOCK: usize = 512;
/// Tar record size: the archive is zero-padded to a multiple of it.
pub const RECORD: u64 = 10_240;

const MODE: &[u8; 8] = b"0000644\0";
const ID: &[u8; 8] = b"0000000\0";
const MTIME: &[u8; 12] = b"00000000000\0";
const MAGIC: &[u8; 8] = b"ustar\x0000";
/// The largest size the 11-digit octal field can state (8 GiB − 1).
pub const MAX_OCTAL_SIZE: u64 = 0o77_777_777_777;

/// The 512-byte header of a member `name` of `size` bytes (§6.2).
///
/// `name` must be ASCII and at most 100 bytes and `size` at most
/// [`MAX_OCTAL_SIZE`]; the envelope only ever passes its own member names and
/// sizes that the limits of §6.5 already bound.
pub fn header(name: &str, size: u64) -> [u8; BLOCK] {
    assert!(name.is_ascii() && name.len() <= 100, "tar name {name:?}");
    assert!(size <= MAX_OCTAL_SIZE, "tar size {size}");
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name.as_bytes());
    h[100..108].copy_from_slice(MODE);
    h[108..116].copy_from_slice(ID);
    h[116..124].copy_from_slice(ID);
    h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
    h[136..148].copy_from_slice(MTIME);
    h[148..156].copy_from_slice(b"        ");
    h[156] = b'0';
    h[257..265].copy_from_slice(MAGIC);
    let sum = checksum(&h);
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// The unsigned byte sum of a header with its checksum field taken as spaces.
fn checksum(h: &[u8; BLOCK]) -> u32 {
    let mut sum: u32 = 0;
    for (i, &b) in h.iter().enumerate() {
        sum += if (148..156).contains(&i) {
            b' ' as u32
        } else {
            b as u32
        };
    }
    sum
}

/// Padding after `size` data bytes to the next block boundary.
pub fn padding(size: u64) -> usize {
    ((BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64) as usize
}

/// Zero bytes after the end blocks, given the stream length so far
/// (members plus the two end blocks), up to the next record boundary.
pub fn record_padding(len: u64) -> u64 {
    (RECORD - len % RECORD) % RECORD
}

/// The member name a header states: the bytes of its name field up to the
/// first NUL, shown lossily (for messages and for the order check).
pub fn stated_name(h: &[u8; BLOCK]) -> String {
    let end = h[..100].iter().position(|&b| b == 0).unwrap_or(100);
    String::from_utf8_lossy(&h[..end]).into_owned()
}

fn tar_header(name: &str, what: &str) -> Error {
    Error::new(
        Code::ArtifactTarHeader,
        format!("tar header of {name:?} is not canonical: {what}"),
    )
}

/// Check the type flag and name of a header against the member `expected`
/// (`artifact.tar_member`): only regular files (`0`) with exactly the expected
/// name are allowed, with no extension of any kind.
pub fn check_member(h: &[u8; BLOCK], expected: &str) -> Result<()> {
    let name = stated_name(h);
    let flag = h[156];
    if flag != b'0' {
        let what = match flag {
            0 => "an AREGTYPE (NUL typeflag) member".to_owned(),
            b'x' | b'g' => "a pax extended header".to_owned(),
            b'L' | b'K' => "a GNU long name or long link".to_owned(),
            b'S' => "a GNU sparse member".to_owned(),
            b'1' => "a hard link".to_owned(),
            b'2' => "a symbolic link".to_owned(),
            b'5' => "a directory".to_owned(),
            b'3' | b'4' | b'6' => "a device or FIFO".to_owned(),
            other => format!("a member of typeflag {:?}", other as char),
        };
        return Err(Error::new(
            Code::ArtifactTarMember,
            format!("envelope member {name:?} is {what}; only regular files are allowed"),
        ));
    }
    if name != expected {
        return Err(Error::new(
            Code::ArtifactTarMember,
            format!("envelope member {name:?} is not allowed here: expected {expected:?}"),
        ));
    }
    Ok(())
}

/// Check every field of a header of member `name` against §6.2 exactly and
/// return its stated size (`artifact.tar_header`).
pub fn check_fields(h: &[u8; BLOCK], name: &str) -> Result<u64> {
    let nl = name.len();
    if &h[..nl] != name.as_bytes() || h[nl..100].iter().any(|&b| b != 0) {
        return Err(tar_header(name, "name field is not NUL-padded"));
    }
    if &h[100..108] != MODE {
        return Err(tar_header(name, "mode is not 0000644"));
    }
    if &h[108..116] != ID || &h[116..124] != ID {
        return Err(tar_header(name, "uid or gid is not 0000000"));
    }
    let size_field = &h[124..136];
    if size_field[0] & 0x80 != 0 {
        return Err(tar_header(name, "base-256 sizes are not allowed"));
    }
    if size_field[11] != 0 || !size_field[..11].iter().all(|b| (b'0'..=b'7').contains(b)) {
        return Err(tar_header(name, "size is not 11 octal digits and NUL"));
    }
    let mut size: u64 = 0;
    for &b in &size_field[..11] {
        size = size * 8 + (b - b'0') as u64;
    }
    if &h[136..148] != MTIME {
        return Err(tar_header(name, "mtime is not 00000000000"));
    }
    let ck = &h[148..156];
    if ck[6] != 0 || ck[7] != b' ' || !ck[..6].iter().all(|b| (b'0'..=b'7').contains(b)) {
        return Err(tar_header(
            name,
            "checksum is not 6 octal digits, NUL and space",
        ));
    }
    let mut stated: u32 = 0;
    for &b in &ck[..6] {
        stated = stated * 8 + (b - b'0') as u32;
    }
    if stated != checksum(h) {
        return Err(tar_header(name, "checksum does not match the header"));
    }
    if h[156] != b'0' {
        return Err(tar_header(name, "typeflag is not 0"));
    }
    if h[157..257].iter().any(|&b| b != 0) {
        return Err(tar_header(name, "linkname is not empty"));
    }
    if &h[257..265] != MAGIC {
        return Err(tar_header(name, "magic and version are not ustar NUL 00"));
    }
    if h[265..BLOCK].iter().any(|&b| b != 0) {
        return Err(tar_header(
            name,
            "uname, gname, devmajor, devminor, prefix or the tail is not NUL",
        ));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_of_the_spec_example() {
        let h = header("metadata.json", 884);
        assert_eq!(&h[124..136], b"00000001564\0");
        assert_eq!(&h[148..156], b"010426\0 ");
        assert_eq!(check_fields(&h, "metadata.json").unwrap(), 884);
        check_member(&h, "metadata.json").unwrap();
    }

    #[test]
    fn padding_rules() {
        assert_eq!(padding(0), 0);
        assert_eq!(padding(1), 511);
        assert_eq!(padding(512), 0);
        assert_eq!(record_padding(10_240), 0);
        assert_eq!(record_padding(2048), 8192);
    }
}

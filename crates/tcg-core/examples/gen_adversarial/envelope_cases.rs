//! Envelope-level cases: gzip framing, tar members and tar header fields.

use super::fixtures::*;
use tcg_core::artifact::tar;

/// Append the envelope-level cases.
pub fn cases(b: &Bases, add: Add<'_>) {
    let good_a = env(&b.md_a, &b.pkg_a, None);
    // gzip framing (§6.6 steps 2-4)
    let n = good_a.len();
    add(
        "gzip-truncated-body.tar.gz",
        Some("artifact.truncated_gzip"),
        "cut in the deflate body",
        good_a[..n / 2].to_vec(),
    );
    add(
        "gzip-truncated-trailer.tar.gz",
        Some("artifact.truncated_gzip"),
        "last 4 trailer bytes missing",
        good_a[..n - 4].to_vec(),
    );
    add(
        "gzip-header-only.tar.gz",
        Some("artifact.truncated_gzip"),
        "a gzip header and nothing else",
        good_a[..10].to_vec(),
    );
    add(
        "gzip-two-members.tar.gz",
        Some("artifact.gzip_trailing"),
        "two complete gzip members",
        [good_a.clone(), good_a.clone()].concat(),
    );
    add(
        "gzip-empty-second-member.tar.gz",
        Some("artifact.gzip_trailing"),
        "an empty gzip member appended",
        [good_a.clone(), gzip(b"")].concat(),
    );
    add(
        "gzip-trailing-byte.tar.gz",
        Some("artifact.gzip_trailing"),
        "one byte after the trailer",
        [good_a.clone(), b"x".to_vec()].concat(),
    );
    add(
        "gzip-trailing-nul.tar.gz",
        Some("artifact.gzip_trailing"),
        "one NUL after the trailer",
        [good_a.clone(), vec![0]].concat(),
    );
    let mut c = good_a.clone();
    c[n - 8] ^= 1;
    add(
        "gzip-bad-crc.tar.gz",
        Some("artifact.gzip_invalid"),
        "CRC-32 off by one bit",
        c,
    );
    let mut c = good_a.clone();
    c[n - 4] ^= 1;
    add(
        "gzip-bad-isize.tar.gz",
        Some("artifact.gzip_invalid"),
        "ISIZE off by one bit",
        c,
    );
    let mut c = good_a.clone();
    c[10] = 0x07;
    add(
        "gzip-deflate-error.tar.gz",
        Some("artifact.gzip_invalid"),
        "a reserved deflate block type",
        c,
    );
    let mut c = good_a.clone();
    c[3] = 0x08;
    add(
        "gzip-fname-flag.tar.gz",
        Some("artifact.gzip_header"),
        "FLG has FNAME set",
        c,
    );
    let mut c = good_a.clone();
    c[2] = 7;
    add(
        "gzip-method.tar.gz",
        Some("artifact.gzip_header"),
        "CM is not deflate",
        c,
    );
    add(
        "gzip-not-gzip.tar.gz",
        Some("artifact.gzip_header"),
        "plain text",
        b"hello, world\n".to_vec(),
    );
    add(
        "gzip-empty-file.tar.gz",
        Some("artifact.gzip_header"),
        "an empty file",
        Vec::new(),
    );
    add(
        "bare-pt2.tar.gz",
        Some("artifact.bare_pt2"),
        "a bare model.pt2 instead of an envelope",
        b.pkg_a.clone(),
    );
    add(
        "bare-pt2-empty-zip.tar.gz",
        Some("artifact.bare_pt2"),
        "an empty zip (end record only)",
        zip(&[]),
    );

    // tar members (§6.6 step 5)
    let m_md = member("metadata.json", &b.md_a);
    let m_pkg = member("model.pt2", &b.pkg_a);
    let t = |parts: &[&[u8]]| gzip(&finish_tar(parts.concat()));
    let big = |h: &mut [u8; 512]| h[124..136].copy_from_slice(b"00040000001\0");
    let mut hdr = tar::header("metadata.json", 0);
    big(&mut hdr);
    add(
        "tar-oversized-metadata.tar.gz",
        Some("artifact.member_too_large"),
        "metadata declares 8 MiB + 1 bytes",
        gzip(&recheck(hdr)),
    );
    let typed = |flag: u8, name: &str| edited(name, b"", |h| h[156] = flag);
    add(
        "tar-pax-header.tar.gz",
        Some("artifact.tar_member"),
        "a pax extended header first",
        t(&[&typed(b'x', "PaxHeaders/metadata.json"), &m_md, &m_pkg]),
    );
    add(
        "tar-pax-global.tar.gz",
        Some("artifact.tar_member"),
        "a pax global header first",
        t(&[&typed(b'g', "pax_global_header"), &m_md, &m_pkg]),
    );
    add(
        "tar-gnu-longname.tar.gz",
        Some("artifact.tar_member"),
        "a GNU long-name member",
        t(&[&typed(b'L', "././@LongLink"), &m_md, &m_pkg]),
    );
    add(
        "tar-aregtype.tar.gz",
        Some("artifact.tar_member"),
        "metadata with the AREGTYPE NUL typeflag",
        t(&[&edited("metadata.json", &b.md_a, |h| h[156] = 0), &m_pkg]),
    );
    add(
        "tar-symlink.tar.gz",
        Some("artifact.tar_member"),
        "metadata.json is a symlink",
        t(&[
            &edited("metadata.json", b"", |h| {
                h[156] = b'2';
                h[157..166].copy_from_slice(b"/etc/pass");
            }),
            &m_pkg,
        ]),
    );
    add(
        "tar-hardlink.tar.gz",
        Some("artifact.tar_member"),
        "model.pt2 is a hard link",
        t(&[
            &m_md,
            &edited("model.pt2", b"", |h| {
                h[156] = b'1';
                h[157..170].copy_from_slice(b"metadata.json");
            }),
        ]),
    );
    add(
        "tar-directory.tar.gz",
        Some("artifact.tar_member"),
        "a directory member",
        t(&[&typed(b'5', "metadata.json"), &m_pkg]),
    );
    add(
        "tar-dotdot-name.tar.gz",
        Some("artifact.tar_member"),
        "a ../ member name",
        t(&[&member("../metadata.json", &b.md_a), &m_pkg]),
    );
    add(
        "tar-duplicate-metadata.tar.gz",
        Some("artifact.tar_member"),
        "metadata.json twice",
        t(&[&m_md, &m_md, &m_pkg]),
    );
    add(
        "tar-duplicate-model.tar.gz",
        Some("artifact.tar_member"),
        "model.pt2 twice",
        t(&[&m_md, &m_pkg, &m_pkg]),
    );
    add(
        "tar-missing-model.tar.gz",
        Some("artifact.member_missing"),
        "metadata only",
        t(&[&m_md]),
    );
    add(
        "tar-empty-archive.tar.gz",
        Some("artifact.member_missing"),
        "end blocks only",
        t(&[]),
    );
    add(
        "tar-unexpected-member.tar.gz",
        Some("artifact.tar_member"),
        "an extra member after model.pt2",
        t(&[&m_md, &m_pkg, &member("extra.txt", b"x")]),
    );
    add(
        "tar-member-after-literals.tar.gz",
        Some("artifact.tar_member"),
        "an extra member after constants.safetensors",
        gzip(&finish_tar(
            [
                member("metadata.json", &b.md_b),
                member("model.pt2", &b.pkg_b),
                member("constants.safetensors", &b.lit_b),
                member("extra.txt", b"x"),
            ]
            .concat(),
        )),
    );
    add(
        "tar-wrong-order.tar.gz",
        Some("artifact.tar_member"),
        "model.pt2 before metadata.json",
        t(&[&m_pkg, &m_md]),
    );
    add(
        "tar-literals-before-model.tar.gz",
        Some("artifact.tar_member"),
        "constants.safetensors before model.pt2",
        gzip(&finish_tar(
            [
                member("metadata.json", &b.md_b),
                member("constants.safetensors", &b.lit_b),
                member("model.pt2", &b.pkg_b),
            ]
            .concat(),
        )),
    );
    let body = [m_md.clone(), m_pkg.clone()].concat();
    let mut c = finish_tar(body.clone());
    c[body.len() + 700] = 1;
    add(
        "tar-nonzero-end-block.tar.gz",
        Some("artifact.tar_end"),
        "a byte set in the second end block",
        gzip(&c),
    );
    let mut c = finish_tar(body.clone());
    let l = c.len();
    c[l - 1] = 1;
    add(
        "tar-nonzero-record-padding.tar.gz",
        Some("artifact.tar_end"),
        "a byte set in the record padding",
        gzip(&c),
    );
    let mut c = finish_tar(body.clone());
    c[512 + b.md_a.len() + 3] = b'!';
    add(
        "tar-nonzero-member-padding.tar.gz",
        Some("artifact.tar_end"),
        "a byte set in metadata's NUL padding",
        gzip(&c),
    );
    let mut c = finish_tar(body.clone());
    c.extend_from_slice(&[0u8; 10_240]);
    add(
        "tar-extra-record.tar.gz",
        Some("artifact.tar_end"),
        "a further zero record after the end",
        gzip(&c),
    );
    let c = finish_tar(body.clone());
    add(
        "tar-short-record-padding.tar.gz",
        Some("artifact.tar_truncated"),
        "record padding cut short",
        gzip(&c[..c.len() - 512]),
    );
    add(
        "tar-truncated-model.tar.gz",
        Some("artifact.tar_truncated"),
        "model.pt2 data cut short",
        gzip(&body[..body.len() - 700]),
    );
    add(
        "tar-no-end-blocks.tar.gz",
        Some("artifact.tar_truncated"),
        "members without end blocks",
        gzip(&body),
    );

    // tar header fields (§6.2 exactness)
    let hdr_case = |f: &dyn Fn(&mut [u8; 512])| t(&[&edited("metadata.json", &b.md_a, f), &m_pkg]);
    add(
        "hdr-mode.tar.gz",
        Some("artifact.tar_header"),
        "mode 0000755",
        hdr_case(&|h| h[100..108].copy_from_slice(b"0000755\0")),
    );
    add(
        "hdr-uid.tar.gz",
        Some("artifact.tar_header"),
        "uid 0001750",
        hdr_case(&|h| h[108..116].copy_from_slice(b"0001750\0")),
    );
    add(
        "hdr-gid-space.tar.gz",
        Some("artifact.tar_header"),
        "gid terminated by a space",
        hdr_case(&|h| h[116..124].copy_from_slice(b"0000000 ")),
    );
    add(
        "hdr-mtime.tar.gz",
        Some("artifact.tar_header"),
        "a non-zero mtime",
        hdr_case(&|h| h[136..148].copy_from_slice(b"14707444200\0")),
    );
    add(
        "hdr-base256-size.tar.gz",
        Some("artifact.tar_header"),
        "a base-256 size",
        hdr_case(&|h| {
            let n = b.md_a.len() as u64;
            h[124..136].fill(0);
            h[124] = 0x80;
            h[128..136].copy_from_slice(&n.to_be_bytes());
        }),
    );
    add(
        "hdr-size-space.tar.gz",
        Some("artifact.tar_header"),
        "size field terminated by a space",
        hdr_case(&|h| h[135] = b' '),
    );
    add(
        "hdr-uname.tar.gz",
        Some("artifact.tar_header"),
        "uname root",
        hdr_case(&|h| h[265..269].copy_from_slice(b"root")),
    );
    add(
        "hdr-gnu-magic.tar.gz",
        Some("artifact.tar_header"),
        "GNU magic ustar space space",
        hdr_case(&|h| h[257..265].copy_from_slice(b"ustar  \0")),
    );
    add(
        "hdr-prefix.tar.gz",
        Some("artifact.tar_header"),
        "a non-empty prefix",
        hdr_case(&|h| h[345..348].copy_from_slice(b"dir")),
    );
    add(
        "hdr-name-garbage.tar.gz",
        Some("artifact.tar_header"),
        "bytes after the name's NUL",
        hdr_case(&|h| h[60] = b'x'),
    );
    add(
        "hdr-devmajor.tar.gz",
        Some("artifact.tar_header"),
        "devmajor 0000000",
        hdr_case(&|h| h[329..337].copy_from_slice(b"0000000\0")),
    );
    let mut h = tar::header("metadata.json", b.md_a.len() as u64);
    let stated = std::str::from_utf8(&h[148..154]).unwrap().to_owned();
    h[148..156].copy_from_slice(format!("0{stated}\0").as_bytes());
    add(
        "hdr-checksum-format.tar.gz",
        Some("artifact.tar_header"),
        "checksum as 7 digits and NUL",
        t(&[&member_with(h, &b.md_a), &m_pkg]),
    );
    let mut h = tar::header("metadata.json", b.md_a.len() as u64);
    h[153] = if h[153] == b'0' { b'1' } else { b'0' };
    add(
        "hdr-checksum-wrong.tar.gz",
        Some("artifact.tar_header"),
        "checksum value wrong",
        t(&[&member_with(h, &b.md_a), &m_pkg]),
    );
}

//! The gzip framing of the envelope (SPEC-v1 §6.3, §6.6 steps 2–4), written
//! and parsed here around a raw deflate stream so that the header, the
//! CRC-32, ISIZE and any byte after the one member are checked exactly.

use std::io::{Read, Write};

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// The gzip CRC-32 and length of the uncompressed stream (RFC 1952 trailer),
/// on `crc32fast`, which picks the carry-less-multiply kernel at run time
/// (flate2's own `Crc` on the zlib-rs backend ran the portable kernel here,
/// several times slower over a large artifact).
#[derive(Default)]
struct Crc {
    hasher: crc32fast::Hasher,
    amount: u32,
}

impl Crc {
    fn new() -> Self {
        Crc::default()
    }

    fn update(&mut self, data: &[u8]) {
        self.hasher.update(data);
        self.amount = self.amount.wrapping_add(data.len() as u32);
    }

    fn sum(&self) -> u32 {
        self.hasher.clone().finalize()
    }

    fn amount(&self) -> u32 {
        self.amount
    }
}

use super::limits::{inflation_cap, MAX_INFLATION_RATIO, MAX_TAR_BYTES};
use crate::error::{Code, Error, Result};

/// The exact 10-byte header the writer emits: CM 8, FLG 0, MTIME 0, XFL 2,
/// OS 255.
pub const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0x02, 0xff];

/// The message of `artifact.bare_pt2` (§6.6 step 2).
pub const BARE_PT2_MESSAGE: &str =
    "format skew: expected a compiled_graph.tar.gz envelope, got a bare .pt2 package; re-publish it as an envelope";

const IN_BUF: usize = 256 * 1024;

fn gzip_invalid(what: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactGzipInvalid,
        format!("envelope gzip stream is invalid: {what}"),
    )
}

fn truncated() -> Error {
    Error::new(
        Code::ArtifactTruncatedGzip,
        "envelope gzip stream is truncated: input ended before the end of the deflate stream and trailer",
    )
}

/// Classify the first bytes of a would-be envelope (§6.6 steps 2–3): a bare
/// package is `artifact.bare_pt2`, anything that is not a gzip header of
/// CM 8 and FLG 0 is `artifact.gzip_header`.
pub fn check_header(head: &[u8]) -> Result<()> {
    if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        return Err(Error::new(Code::ArtifactBarePt2, BARE_PT2_MESSAGE));
    }
    if head.len() < 2 || head[0] != 0x1f || head[1] != 0x8b {
        return Err(Error::new(
            Code::ArtifactGzipHeader,
            "not an envelope: the input does not start with a gzip header",
        ));
    }
    if head.len() < 10 {
        return Err(truncated());
    }
    if head[2] != 8 {
        return Err(Error::new(
            Code::ArtifactGzipHeader,
            format!(
                "envelope gzip header has compression method {}, expected 8 (deflate)",
                head[2]
            ),
        ));
    }
    if head[3] != 0 {
        return Err(Error::new(
            Code::ArtifactGzipHeader,
            format!(
                "envelope gzip header has flags {:#04x}, expected 0",
                head[3]
            ),
        ));
    }
    Ok(())
}

/// A strict one-member gzip reader over any byte source. [`GzipReader::read`]
/// yields the decompressed stream and returns 0 at the end of the deflate
/// stream; [`GzipReader::finish`] then checks the trailer and that nothing
/// follows it.
pub struct GzipReader<R> {
    inner: R,
    buf: Box<[u8]>,
    pos: usize,
    len: usize,
    eof: bool,
    inflate: Decompress,
    crc: Crc,
    out_total: u64,
    in_total: u64,
    ended: bool,
    limit: u64,
}

impl<R: Read> GzipReader<R> {
    /// Read and check the gzip header from `inner`.
    pub fn new(inner: R) -> Result<Self> {
        GzipReader::with_limit(inner, MAX_TAR_BYTES)
    }

    /// As [`GzipReader::new`], refusing more than `limit` decompressed bytes
    /// instead of `MAX_TAR_BYTES` (for tests of the ceiling).
    pub fn with_limit(inner: R, limit: u64) -> Result<Self> {
        let mut r = GzipReader {
            inner,
            buf: vec![0u8; IN_BUF].into_boxed_slice(),
            pos: 0,
            len: 0,
            eof: false,
            inflate: Decompress::new(false),
            crc: Crc::new(),
            out_total: 0,
            in_total: 0,
            ended: false,
            limit,
        };
        // Gather up to 10 bytes (or what there is) to classify the start.
        while r.len < 10 && !r.eof {
            r.fill_more()?;
        }
        check_header(&r.buf[..r.len])?;
        r.pos = 10;
        Ok(r)
    }

    /// Read more input after the bytes already buffered (compacting first).
    fn fill_more(&mut self) -> Result<()> {
        if self.pos > 0 {
            self.buf.copy_within(self.pos..self.len, 0);
            self.len -= self.pos;
            self.pos = 0;
        }
        if self.len == self.buf.len() {
            return Err(gzip_invalid("the deflate stream makes no progress"));
        }
        loop {
            match self.inner.read(&mut self.buf[self.len..]) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Ok(n) => {
                    self.len += n;
                    self.in_total += n as u64;
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io("cannot read the envelope", &e)),
            }
        }
    }

    /// Decompressed bytes into `out`; 0 means the deflate stream has ended.
    /// More than `MAX_TAR_BYTES` in all is `artifact.decompressed_too_large`.
    pub fn read(&mut self, out: &mut [u8]) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            if self.ended {
                return Ok(0);
            }
            if self.pos == self.len {
                if self.eof {
                    return Err(truncated());
                }
                self.fill_more()?;
                continue;
            }
            let in0 = self.inflate.total_in();
            let out0 = self.inflate.total_out();
            let status = self
                .inflate
                .decompress(&self.buf[self.pos..self.len], out, FlushDecompress::None)
                .map_err(|e| {
                    // The inflater could not allocate its window: a failure
                    // of this process, not evidence about the envelope.
                    if e.to_string().contains("insufficient memory") {
                        Error::io_code(
                            Code::IoError,
                            Some(libc::ENOMEM),
                            format!("cannot inflate the envelope: {e}"),
                        )
                    } else {
                        gzip_invalid(format_args!("deflate error: {e}"))
                    }
                })?;
            let consumed = (self.inflate.total_in() - in0) as usize;
            let produced = (self.inflate.total_out() - out0) as usize;
            self.pos += consumed;
            if status == Status::StreamEnd {
                self.ended = true;
            }
            if produced > 0 {
                self.out_total += produced as u64;
                if self.out_total > self.limit {
                    return Err(Error::new(
                        Code::ArtifactDecompressedTooLarge,
                        format!("envelope decompresses to more than {} bytes", self.limit),
                    ));
                }
                // Checked as the stream goes, against the compressed bytes
                // consumed so far, so a bomb stops after a bounded amount of
                // output whatever its length.
                let consumed_in = self.inflate.total_in() + 10;
                if self.out_total > inflation_cap(consumed_in) {
                    return Err(Error::new(
                        Code::ArtifactInflationRatio,
                        format!(
                            "envelope inflated to {} bytes from {consumed_in} compressed bytes, over the cap of {} (the allowance plus {MAX_INFLATION_RATIO}:1)",
                            self.out_total,
                            inflation_cap(consumed_in)
                        ),
                    ));
                }
                self.crc.update(&out[..produced]);
                return Ok(produced);
            }
            if consumed == 0 && !self.ended {
                // No progress with the input at hand: it needs more.
                if self.eof {
                    return Err(truncated());
                }
                self.fill_more()?;
            }
        }
    }

    /// Decompressed bytes so far.
    pub fn total_out(&self) -> u64 {
        self.out_total
    }

    /// After [`GzipReader::read`] returned 0: check the CRC-32 and ISIZE
    /// trailer (`artifact.gzip_invalid`, `artifact.truncated_gzip`) and that
    /// no byte follows it (`artifact.gzip_trailing`). Returns the number of
    /// compressed bytes read, and the source.
    pub fn finish(mut self) -> Result<(u64, R)> {
        debug_assert!(self.ended, "finish before the end of the deflate stream");
        while self.len - self.pos < 8 && !self.eof {
            self.fill_more()?;
        }
        if self.len - self.pos < 8 {
            return Err(truncated());
        }
        let t = &self.buf[self.pos..self.pos + 8];
        let crc = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
        let isize = u32::from_le_bytes([t[4], t[5], t[6], t[7]]);
        self.pos += 8;
        if crc != self.crc.sum() {
            return Err(gzip_invalid(format_args!(
                "CRC-32 {crc:08x} does not match the data ({:08x})",
                self.crc.sum()
            )));
        }
        if isize != self.out_total as u32 {
            return Err(gzip_invalid(format_args!(
                "ISIZE {isize} does not match the data length mod 2^32 ({})",
                self.out_total as u32
            )));
        }
        if self.pos == self.len && !self.eof {
            self.fill_more()?;
        }
        if self.pos < self.len {
            let what = if self.buf[self.pos..self.len].starts_with(&[0x1f]) {
                "a further gzip member follows"
            } else {
                "bytes follow the gzip trailer"
            };
            return Err(Error::new(
                Code::ArtifactGzipTrailing,
                format!("an envelope holds exactly one gzip member: {what}"),
            ));
        }
        Ok((self.in_total, self.inner))
    }
}

/// A gzip writer of the §6.3 shape: the fixed header, one raw deflate stream
/// at maximum compression, and the CRC-32 and ISIZE trailer.
pub struct GzipWriter<W: Write> {
    out: W,
    deflate: Compress,
    crc: Crc,
    buf: Vec<u8>,
}

fn write_err(e: &std::io::Error) -> Error {
    Error::io("cannot write the envelope", e)
}

impl<W: Write> GzipWriter<W> {
    /// Start a stream: write the header to `out`.
    pub fn new(mut out: W) -> Result<Self> {
        out.write_all(&GZIP_HEADER).map_err(|e| write_err(&e))?;
        Ok(GzipWriter {
            out,
            deflate: Compress::new(Compression::best(), false),
            crc: Crc::new(),
            buf: Vec::with_capacity(IN_BUF),
        })
    }

    fn pump(&mut self, mut input: &[u8], flush: FlushCompress) -> Result<()> {
        loop {
            self.buf.clear();
            let in0 = self.deflate.total_in();
            let status = self
                .deflate
                .compress_vec(input, &mut self.buf, flush)
                .map_err(|e| Error::io("cannot deflate the envelope", &std::io::Error::other(e)))?;
            let consumed = (self.deflate.total_in() - in0) as usize;
            input = &input[consumed..];
            self.out.write_all(&self.buf).map_err(|e| write_err(&e))?;
            let done = match flush {
                FlushCompress::Finish => status == Status::StreamEnd,
                _ => input.is_empty() && self.buf.len() < self.buf.capacity(),
            };
            if done {
                return Ok(());
            }
        }
    }

    /// Append tar stream bytes.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        self.crc.update(data);
        self.pump(data, FlushCompress::None)
    }

    /// End the deflate stream, write the trailer and return the sink.
    pub fn finish(mut self) -> Result<W> {
        self.pump(&[], FlushCompress::Finish)?;
        let mut trailer = [0u8; 8];
        trailer[..4].copy_from_slice(&self.crc.sum().to_le_bytes());
        trailer[4..].copy_from_slice(&self.crc.amount().to_le_bytes());
        self.out.write_all(&trailer).map_err(|e| write_err(&e))?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut w = GzipWriter::new(Vec::new()).unwrap();
        w.write(data).unwrap();
        w.finish().unwrap()
    }

    fn drain<R: Read>(r: &mut GzipReader<R>) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&buf[..n]);
        }
    }

    #[test]
    fn a_round_trip_reads_back_and_finishes() {
        let data: Vec<u8> = (0..100_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        let bytes = gz(&data);
        let mut r = GzipReader::new(&bytes[..]).unwrap();
        assert_eq!(drain(&mut r).unwrap(), data);
        assert_eq!(r.finish().unwrap().0, bytes.len() as u64);
    }

    #[test]
    fn the_decompressed_ceiling_is_enforced() {
        let bytes = gz(&vec![0u8; 100_000]);
        let mut r = GzipReader::with_limit(&bytes[..], 99_999).unwrap();
        assert_eq!(
            drain(&mut r).unwrap_err().code(),
            Code::ArtifactDecompressedTooLarge
        );
        let mut r = GzipReader::with_limit(&bytes[..], 100_000).unwrap();
        assert_eq!(drain(&mut r).unwrap().len(), 100_000);
    }

    #[test]
    fn read_errors_of_the_source_are_io_errors() {
        struct Failing;
        impl Read for Failing {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                Err(std::io::Error::from_raw_os_error(libc::EIO))
            }
        }
        let err = GzipReader::new(Failing).err().unwrap();
        assert_eq!(err.code(), Code::IoError);
        assert_eq!(err.errno(), Some(libc::EIO));
    }
}

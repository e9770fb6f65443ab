//! The HTTP layer's bounds (docs/fleet.md, "What the client caps"): every
//! response body the client reads passes through [`Guard`], which caps it
//! before `object_store` (or anything else) can gather it.
//!
//! - An error answer (any status but 2xx) is cut after [`MAX_ERROR_BODY_BYTES`]:
//!   `object_store` reads the whole body of an error into its message, and a
//!   hostile or broken server can make that body as large as it likes.
//! - A successful answer is bounded by what it can be: a ref, lease,
//!   manifest or signature record by its documented limit, a chunk by the
//!   largest chunk, a listing page by [`MAX_LIST_PAGE_BYTES`]. More is an error
//!   (the body is not read further).
//! - A listing page is read here (bounded), and every entry whose name,
//!   size or time cannot be parsed is dropped and recorded for the caller
//!   ([`collect_skipped`]), so that one hostile name cannot fail a whole
//!   listing; a page that says it is truncated but gives no continuation
//!   token is an error, never the end of the listing.
//!
//! The deadline of each exchange (headers and body) is the caller's
//! (`client.rs`, `fetch.rs`): the cap bounds memory, the deadline time.

use std::cell::RefCell;
use std::pin::Pin;
use std::task::{Context, Poll};

use async_trait::async_trait;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse,
    HttpResponseBody, HttpService, ReqwestConnector,
};
use object_store::path::Path;
use object_store::ClientOptions;

use crate::layout::{MAX_LEASE_BYTES, MAX_MANIFEST_BYTES, MAX_REF_BYTES};
use crate::signatures::MAX_RECORD_BYTES;

/// Most bytes of an error answer's body that are read (the rest is dropped).
pub const MAX_ERROR_BODY_BYTES: u64 = 4096;
/// Largest listing page read (S3 returns at most 1000 names of at most 1024
/// bytes a page: about 1.5 MB of XML).
pub const MAX_LIST_PAGE_BYTES: u64 = 8 << 20;
/// Largest body of an answer to anything but a GET (PUT, HEAD, DELETE).
pub const MAX_OTHER_BODY_BYTES: u64 = 64 * 1024;
/// Largest report or doctor probe object read.
pub const MAX_SMALL_OBJECT_BYTES: u64 = 64 * 1024;
/// Most skipped listing entries recorded by name per listing (the rest are counted).
pub const MAX_SKIPPED_NAMES: usize = 1000;
/// Longest name recorded for a skipped entry (chars; longer names are cut).
pub const MAX_SKIPPED_NAME_CHARS: usize = 1100;

tokio::task_local! {
    static SKIPPED: RefCell<Skipped>;
}

#[derive(Default)]
struct Skipped {
    names: Vec<SkippedEntry>,
    more: usize,
}

/// A listed entry that was skipped: its name as listed (cut to
/// [`MAX_SKIPPED_NAME_CHARS`]) and why it cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedEntry {
    /// The name the store listed.
    pub name: String,
    /// Why it was skipped.
    pub why: String,
}

impl std::fmt::Display for SkippedEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.name, self.why)
    }
}

fn record_skipped(name: &str, why: impl Into<String>) {
    let _ = SKIPPED.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.names.len() < MAX_SKIPPED_NAMES {
            s.names.push(SkippedEntry {
                name: shown(name),
                why: why.into(),
            });
        } else {
            s.more += 1;
        }
    });
}

/// Run `fut`, collecting the listing entries the guard skipped while it ran
/// (past [`MAX_SKIPPED_NAMES`], one more entry counting the rest).
pub(crate) async fn collect_skipped<T>(
    fut: impl std::future::Future<Output = T>,
) -> (T, Vec<SkippedEntry>) {
    SKIPPED
        .scope(RefCell::new(Skipped::default()), async move {
            let out = fut.await;
            let skipped = SKIPPED.with(|s| {
                let s = std::mem::take(&mut *s.borrow_mut());
                let mut names = s.names;
                if s.more > 0 {
                    names.push(SkippedEntry {
                        name: String::new(),
                        why: format!("and {} more unparseable names", s.more),
                    });
                }
                names
            });
            (out, skipped)
        })
        .await
}

/// Connects like the default connector (or the doctor's tampering one),
/// then wraps the client in [`Guard`].
#[derive(Debug, Default)]
pub struct GuardConnector {
    /// The doctor's wrong-checksum probe (tamper.rs) underneath.
    pub tamper: bool,
}

impl HttpConnector for GuardConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = if self.tamper {
            crate::tamper::TamperConnector.connect(options)?
        } else {
            ReqwestConnector::default().connect(options)?
        };
        Ok(HttpClient::new(Guard(inner)))
    }
}

/// Caps every response body (module docs).
#[derive(Debug)]
pub struct Guard(HttpClient);

/// What a request's answer may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A listing page.
    List,
    /// Any other body of at most this many bytes.
    Body(u64),
}

/// The bound of the answer to `method` on `path?query` (layout.rs names).
fn expect(method: &str, path: &str, query: Option<&str>) -> Expect {
    let listing = query.is_some_and(|q| q.split('&').any(|p| p == "list-type=2"));
    if method != "GET" {
        return Expect::Body(MAX_OTHER_BODY_BYTES);
    }
    if listing {
        return Expect::List;
    }
    let folder = |name: &str| path.contains(&format!("/{}/{name}/", crate::layout::LAYOUT_ROOT));
    let cap = if folder("chunks") {
        tcg_cas::MAX_CHUNK_BYTES
    } else if folder("manifests") {
        MAX_MANIFEST_BYTES
    } else if folder("refs") {
        MAX_REF_BYTES
    } else if folder("leases") {
        MAX_LEASE_BYTES
    } else if folder("signatures") {
        MAX_RECORD_BYTES
    } else {
        MAX_SMALL_OBJECT_BYTES
    };
    Expect::Body(cap)
}

fn over(what: &str, cap: u64) -> HttpError {
    HttpError::new(
        HttpErrorKind::Decode,
        std::io::Error::other(format!("{what} is over the limit of {cap} bytes")),
    )
}

#[async_trait]
impl HttpService for Guard {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let method = req.method().as_str().to_string();
        let path = req.uri().path().to_string();
        let query = req.uri().query().map(str::to_string);
        let response = self.0.execute(req).await?;
        let (parts, body) = response.into_parts();
        if !parts.status.is_success() {
            let body = Capped::new(body, MAX_ERROR_BODY_BYTES, Beyond::Cut);
            return Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(body)));
        }
        match expect(&method, &path, query.as_deref()) {
            Expect::Body(cap) => {
                let body = Capped::new(body, cap, Beyond::Fail("the answer's body"));
                Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(body)))
            }
            Expect::List => {
                let capped = Capped::new(body, MAX_LIST_PAGE_BYTES, Beyond::Fail("a listing page"));
                let page = HttpResponseBody::new(capped).bytes().await?;
                let clean = clean_page(&page).map_err(|why| {
                    HttpError::new(HttpErrorKind::Decode, std::io::Error::other(why))
                })?;
                Ok(HttpResponse::from_parts(
                    parts,
                    HttpResponseBody::from(clean),
                ))
            }
        }
    }
}

/// What to do with bytes past the cap.
#[derive(Debug, Clone, Copy)]
enum Beyond {
    /// End the body there (an error answer: its first bytes are the message).
    Cut,
    /// Fail the body (a success answer cannot be longer than its kind).
    Fail(&'static str),
}

/// A body that yields at most `left` bytes.
struct Capped {
    inner: Option<HttpResponseBody>,
    left: u64,
    cap: u64,
    beyond: Beyond,
}

impl Capped {
    fn new(inner: HttpResponseBody, cap: u64, beyond: Beyond) -> Capped {
        Capped {
            inner: Some(inner),
            left: cap,
            cap,
            beyond,
        }
    }
}

impl Body for Capped {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = match Pin::new(inner).poll_frame(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(None) => {
                this.inner = None;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Err(e))) => {
                this.inner = None;
                return Poll::Ready(Some(Err(e)));
            }
            Poll::Ready(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            // Trailers: nothing the client reads.
            return Poll::Ready(Some(Ok(Frame::data(Bytes::new()))));
        };
        let len = data.len() as u64;
        if len <= this.left {
            this.left -= len;
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        // Past the cap: the connection is dropped with the rest unread.
        let keep = this.left as usize;
        this.left = 0;
        this.inner = None;
        match this.beyond {
            Beyond::Cut => {
                // Cut at a character boundary: the client reads an error
                // body as text, and a split character would lose the status.
                let mut cut = data.slice(..keep);
                if let Err(e) = std::str::from_utf8(&cut) {
                    if e.error_len().is_none() {
                        cut = cut.slice(..e.valid_up_to());
                    }
                }
                Poll::Ready(Some(Ok(Frame::data(cut))))
            }
            Beyond::Fail(what) => Poll::Ready(Some(Err(over(what, this.cap)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = SizeHint::new();
        if let Some(inner) = &self.inner {
            let upper = inner
                .size_hint()
                .upper()
                .map_or(self.left, |u| u.min(self.left));
            hint.set_upper(upper);
        } else {
            hint.set_upper(0);
        }
        hint
    }
}

mod page {
    use serde::Deserialize;

    /// A ListObjectsV2 page, read leniently: every entry's fields as text.
    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "PascalCase")]
    pub struct Page {
        #[serde(default)]
        pub contents: Vec<Entry>,
        #[serde(default)]
        pub common_prefixes: Vec<Prefix>,
        #[serde(default)]
        pub next_continuation_token: Option<String>,
        #[serde(default)]
        pub is_truncated: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "PascalCase")]
    pub struct Entry {
        #[serde(default)]
        pub key: Option<String>,
        #[serde(default)]
        pub size: Option<String>,
        #[serde(default)]
        pub last_modified: Option<String>,
        #[serde(rename = "ETag", default)]
        pub e_tag: Option<String>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "PascalCase")]
    pub struct Prefix {
        #[serde(default)]
        pub prefix: Option<String>,
    }
}

fn shown(name: &str) -> String {
    let mut s: String = name.chars().take(MAX_SKIPPED_NAME_CHARS).collect();
    if s.len() < name.len() {
        s.push('…');
    }
    s
}

/// Why a listed entry cannot be used, if it cannot.
fn entry_problem(e: &page::Entry) -> Option<String> {
    let Some(key) = e.key.as_deref() else {
        return Some("an entry without a name".into());
    };
    let why = if let Err(err) = Path::parse(key) {
        Some(match err {
            object_store::path::Error::EmptySegment { .. } => "an empty segment (//)".to_string(),
            object_store::path::Error::BadSegment { .. } => {
                "a segment that is not a plain name (. or .. or an illegal character)".to_string()
            }
            _ => "not a usable object name".to_string(),
        })
    } else if key.starts_with('/') || key.ends_with('/') {
        Some("a leading or trailing /".into())
    } else if e
        .size
        .as_deref()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .is_none()
    {
        Some("no integer size".into())
    } else if e
        .last_modified
        .as_deref()
        .and_then(|t| t.trim().parse::<chrono::DateTime<chrono::Utc>>().ok())
        .is_none()
    {
        Some("no readable time".into())
    } else {
        None
    };
    why
}

fn esc(s: &str) -> std::borrow::Cow<'_, str> {
    quick_xml::escape::escape(s)
}

/// The page with its unusable entries dropped (and recorded), rewritten
/// as the plain ListObjectsV2 XML `object_store` reads.
pub fn clean_page(bytes: &[u8]) -> Result<Bytes, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "a listing page is not UTF-8".to_string())?;
    let page: page::Page = quick_xml::de::from_str(text)
        .map_err(|e| format!("a listing page is not readable XML: {e}"))?;
    let truncated = match page.is_truncated.as_deref().map(str::trim) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return Err("a listing page's IsTruncated is neither true nor false".into()),
    };
    let token = page
        .next_continuation_token
        .as_deref()
        .map(str::trim)
        .filter(|t| !t.is_empty());
    if truncated && token.is_none() {
        return Err(
            "a listing page says the listing is truncated but gives no continuation token: \
             the listing cannot be completed"
                .into(),
        );
    }
    let mut out = String::with_capacity(bytes.len());
    out.push_str(r#"<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>"#);
    for e in &page.contents {
        if let Some(why) = entry_problem(e) {
            record_skipped(e.key.as_deref().unwrap_or_default(), why);
            continue;
        }
        let key = e.key.as_deref().unwrap_or_default();
        out.push_str("<Contents><Key>");
        out.push_str(&esc(key));
        out.push_str("</Key><Size>");
        out.push_str(e.size.as_deref().unwrap_or_default().trim());
        out.push_str("</Size><LastModified>");
        out.push_str(&esc(e.last_modified.as_deref().unwrap_or_default().trim()));
        out.push_str("</LastModified>");
        if let Some(tag) = &e.e_tag {
            out.push_str("<ETag>");
            out.push_str(&esc(tag));
            out.push_str("</ETag>");
        }
        out.push_str("</Contents>");
    }
    for p in &page.common_prefixes {
        match p.prefix.as_deref() {
            Some(prefix) if Path::parse(prefix).is_ok() => {
                out.push_str("<CommonPrefixes><Prefix>");
                out.push_str(&esc(prefix));
                out.push_str("</Prefix></CommonPrefixes>");
            }
            other => record_skipped(
                other.unwrap_or_default(),
                "a common prefix that is not a usable name",
            ),
        }
    }
    if let Some(t) = token {
        out.push_str("<NextContinuationToken>");
        out.push_str(&esc(t));
        out.push_str("</NextContinuationToken>");
    }
    out.push_str("</ListBucketResult>");
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_keeps_good_entries_and_skips_bad_ones() {
        let xml = r#"<?xml version="1.0"?><ListBucketResult><IsTruncated>true</IsTruncated>
            <Contents><Key>p/tcg/v1/refs/a</Key><Size>3</Size><LastModified>2026-01-01T00:00:00.000Z</LastModified><ETag>"x"</ETag></Contents>
            <Contents><Key>p/tcg/v1/refs//b</Key><Size>3</Size><LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>
            <Contents><Key>p/tcg/v1/refs/../c</Key><Size>3</Size><LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>
            <Contents><Key>p/tcg/v1/refs/d</Key><Size>-1</Size><LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>
            <NextContinuationToken>t&amp;1</NextContinuationToken></ListBucketResult>"#;
        let (page, skipped) = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(collect_skipped(async { clean_page(xml.as_bytes()) }));
        let page = String::from_utf8(page.unwrap().to_vec()).unwrap();
        assert!(page.contains("<Key>p/tcg/v1/refs/a</Key>"), "{page}");
        assert!(page.contains("t&amp;1"), "{page}");
        assert!(
            !page.contains("//b") && !page.contains("../c") && !page.contains("refs/d"),
            "{page}"
        );
        assert_eq!(skipped.len(), 3, "{skipped:?}");
        assert_eq!(skipped[0].name, "p/tcg/v1/refs//b");
        assert!(skipped[0].why.contains("empty segment"), "{skipped:?}");
    }

    #[test]
    fn a_truncated_page_without_a_token_is_an_error() {
        let xml = "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>";
        let e = clean_page(xml.as_bytes()).unwrap_err();
        assert!(e.contains("no continuation token"), "{e}");
    }

    #[test]
    fn caps_follow_the_layout() {
        assert_eq!(
            expect("GET", "/b/p/tcg/v1/refs/k", None),
            Expect::Body(MAX_REF_BYTES)
        );
        assert_eq!(
            expect("GET", "/b/p/tcg/v1/chunks/sha256/ab/x", None),
            Expect::Body(tcg_cas::MAX_CHUNK_BYTES)
        );
        assert_eq!(
            expect("GET", "/b", Some("list-type=2&prefix=p")),
            Expect::List
        );
        assert_eq!(
            expect("PUT", "/b/p/tcg/v1/refs/k", None),
            Expect::Body(MAX_OTHER_BODY_BYTES)
        );
    }
}

//! `fleet doctor`'s wrong-checksum probe (FLEET.md §7): an HTTP service that
//! alters the body of every PUT after `object_store` has computed its
//! `x-amz-checksum-sha256`, so that the server receives an upload whose
//! checksum does not match its bytes. The payload is sent unsigned
//! (`UNSIGNED-PAYLOAD`), so the only thing that can catch the change is the
//! server's checksum validation. Used by the doctor only, on its own probe
//! object.

use async_trait::async_trait;
use http_body_util::BodyExt;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpRequestBody,
    HttpResponse, HttpService, ReqwestConnector,
};
use object_store::ClientOptions;

/// Connects like the default connector, then wraps the client in [`Tamper`].
#[derive(Debug, Default)]
pub struct TamperConnector;

impl HttpConnector for TamperConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Tamper(inner)))
    }
}

/// Flips one byte in the middle of every non-empty PUT body.
#[derive(Debug)]
pub struct Tamper(HttpClient);

#[async_trait]
impl HttpService for Tamper {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let (parts, body) = req.into_parts();
        let body = if parts.method.as_str() == "PUT" && body.content_length() > 0 {
            // The doctor's probe body is small: gather it, flip its middle byte.
            let mut v: Vec<u8> = body
                .collect()
                .await
                .map_err(|e| HttpError::new(HttpErrorKind::Request, e))?
                .to_bytes()
                .to_vec();
            let mid = v.len() / 2;
            v[mid] ^= 0xff;
            HttpRequestBody::from(v)
        } else {
            body
        };
        self.0.execute(HttpRequest::from_parts(parts, body)).await
    }
}

//! A minimal HTTP/1.1 client for the leasehold API (plain `http://` only): one keep-alive
//! connection, requests sent one after another on it.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// Where the API lives: `host:port` and an optional path prefix (`http://h:8080/prod`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub authority: String,
    pub prefix: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            if url.starts_with("https://") {
                format!("{url:?}: only plain http:// URLs are supported (run `leasehold serve` locally, or put a TLS proxy in front)")
            } else {
                format!("{url:?} is not an http:// URL (example: http://127.0.0.1:7878)")
            }
        })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() || authority.contains(['@', '?', '#', ' ']) {
            return Err(format!("{url:?} has no valid host[:port]"));
        }
        let authority = if authority.rsplit_once(':').is_some_and(|(_, p)| p.chars().all(|c| c.is_ascii_digit()))
            || authority.ends_with(']')
        {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Ok(Endpoint { authority, prefix: path.trim_end_matches('/').to_string() })
    }

    pub fn url(&self) -> String {
        format!("http://{}{}", self.authority, self.prefix)
    }

    pub async fn connect(&self) -> Result<Conn, String> {
        let fail = |e: std::io::Error| format!("cannot reach the leasehold API at {}: {e}", self.url());
        let stream = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(&self.authority))
            .await
            .map_err(|_| fail(std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")))?
            .map_err(fail)?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake with {} failed: {e}", self.url()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Conn { sender, endpoint: self.clone() })
    }
}

/// One keep-alive connection.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
    endpoint: Endpoint,
}

impl Conn {
    /// Sends one request; `path` starts with `/` and is already percent-encoded.
    pub async fn request(&mut self, method: &str, path: &str, body: Option<Vec<u8>>) -> Result<(u16, Bytes), String> {
        let url = format!("{}{path}", self.endpoint.prefix);
        let method = hyper::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
        let mut req =
            hyper::Request::builder().method(method).uri(url.as_str()).header("host", &self.endpoint.authority);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or_default()))).map_err(|e| e.to_string())?;
        self.sender.ready().await.map_err(|e| format!("connection to {} failed: {e}", self.endpoint.url()))?;
        let resp = self
            .sender
            .send_request(req)
            .await
            .map_err(|e| format!("request to {} failed: {e}", self.endpoint.url()))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading the answer of {} failed: {e}", self.endpoint.url()))?
            .to_bytes();
        Ok((status, body))
    }
}

/// Percent-encodes a lease key for the greedy last part of a route path: every byte but
/// the unreserved characters and `/` (the key's own separators travel as path separators,
/// as API Gateway needs them: it decodes the path before it matches a route).
pub fn encode_key(key: &str) -> String {
    const SET: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~').remove(b'/');
    percent_encoding::utf8_percent_encode(key, SET).to_string()
}

/// Percent-encodes a query parameter's value (every byte but the unreserved characters).
pub fn encode_query(value: &str) -> String {
    const SET: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');
    percent_encoding::utf8_percent_encode(value, SET).to_string()
}

/// The path of an operation on `key` (see `leasehold::api::ROUTES`).
pub fn path(op: leasehold::api::Operation, key: &str) -> String {
    use leasehold::api::Operation;
    match op {
        Operation::Get => format!("/leases/{}", encode_key(key)),
        op => format!("/leases/{}/{}", op.as_str(), encode_key(key)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let e = Endpoint::parse("http://127.0.0.1:7878").unwrap();
        assert_eq!((e.authority.as_str(), e.prefix.as_str()), ("127.0.0.1:7878", ""));
        let e = Endpoint::parse("http://example.com/prod/").unwrap();
        assert_eq!((e.authority.as_str(), e.prefix.as_str()), ("example.com:80", "/prod"));
        assert!(Endpoint::parse("https://example.com").unwrap_err().contains("plain http"));
        assert!(Endpoint::parse("127.0.0.1:7878").is_err());
        assert!(Endpoint::parse("http:///x").is_err());
        assert_eq!(encode_key("jobs/nightly run"), "jobs/nightly%20run");
        assert_eq!(encode_key("a%41?#é"), "a%2541%3F%23%C3%A9");
        use leasehold::api::Operation;
        assert_eq!(path(Operation::Acquire, "orders/42"), "/leases/acquire/orders/42");
        assert_eq!(path(Operation::Heartbeat, "k"), "/leases/heartbeat/k");
        assert_eq!(path(Operation::Release, "k"), "/leases/release/k");
        assert_eq!(path(Operation::Get, "acquire/x"), "/leases/acquire/x");
    }
}

//! A small HTTP/1.1 client for tests (one connection per request), on hyper's client API.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// Splits `http://host:port/path` into (`host:port`, `/path`).
fn split(url: &str) -> (String, String) {
    let rest = url.strip_prefix("http://").unwrap_or_else(|| panic!("only http:// URLs: {url}"));
    match rest.find('/') {
        Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
        None => (rest.to_string(), "/".to_string()),
    }
}

pub async fn request(method: &str, url: &str, body: Option<&[u8]>) -> std::io::Result<Response> {
    let json = [("content-type".to_string(), "application/json".to_string())];
    request_with_headers(method, url, &json, body.unwrap_or_default()).await
}

/// A request with the given headers (besides `host`), the answer's headers kept.
pub async fn request_with_headers(
    method: &str,
    url: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> std::io::Result<Response> {
    let (authority, path) = split(url);
    let stream = tokio::net::TcpStream::connect(&authority).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = hyper::Request::builder().method(method).uri(path).header("host", authority);
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req.body(Full::new(Bytes::copy_from_slice(body))).map_err(std::io::Error::other)?;
    let resp = sender.send_request(req).await.map_err(std::io::Error::other)?;
    let status = resp.status().as_u16();
    let headers =
        resp.headers().iter().map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string())).collect();
    let body = resp.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes().to_vec();
    Ok(Response { status, headers, body })
}

pub async fn post_json(url: &str, body: &Value) -> std::io::Result<Response> {
    request("POST", url, Some(body.to_string().as_bytes())).await
}

//! API Gateway HTTP API events: the request as the router reads it, its time left, and the
//! response as API Gateway wants it.

use super::*;

/// Does an acquire request ask to wait for the key?
pub(super) fn asks_to_wait(body: Option<&Value>) -> bool {
    body.and_then(|b| b.get("wait_ms")).and_then(Value::as_u64).is_some_and(|w| w > 0)
}

/// How long API Gateway waits for an HTTP API integration before it answers 503 itself.
pub(crate) const HTTP_API_TIMEOUT: Duration = Duration::from_secs(30);

/// Time left before API Gateway gives up on a request that arrived at `time_epoch_ms`
/// (`requestContext.timeEpoch`); `None` when the event carries no arrival time.
pub(crate) fn http_api_remaining(time_epoch_ms: i64, now_ms: u64) -> Option<Duration> {
    let arrived = u64::try_from(time_epoch_ms).ok().filter(|t| *t > 0)?;
    let deadline = arrived + HTTP_API_TIMEOUT.as_millis() as u64;
    Some(Duration::from_millis(deadline.saturating_sub(now_ms)))
}

/// An HTTP API event as a request, and the time API Gateway still waits for its answer.
/// `now_ms`: the function's wall clock.
pub(super) fn http_request(event: Value, now_ms: u64) -> Result<(HttpRequest, Option<Duration>), Error> {
    let req: ApiGatewayV2httpRequest =
        serde_json::from_value(event).map_err(|e| Error::invalid(format!("malformed HTTP API event: {e}")))?;
    let body = match req.body {
        None => Vec::new(),
        Some(b) if req.is_base64_encoded => aws_smithy_types::base64::decode(&b)
            .map_err(|_| Error::invalid("the body is marked base64 but does not decode"))?,
        Some(b) => b.into_bytes(),
    };
    let remaining = http_api_remaining(req.request_context.time_epoch, now_ms);
    // API Gateway decoded the path once before it matched the route: `rawPath` and
    // `pathParameters` are used as they are, never decoded again.
    let request = HttpRequest {
        method: req.request_context.http.method.as_str().to_string(),
        path: req.raw_path.unwrap_or_default(),
        key: req.path_parameters.get("key").cloned(),
        body,
    };
    Ok((request, remaining))
}

pub(super) fn http_response(r: api::HttpResponse) -> Value {
    let mut out = ApiGatewayV2httpResponse::default();
    out.status_code = r.status as i64;
    for (k, v) in &r.headers {
        if let (Ok(name), Ok(value)) = (
            aws_lambda_events::http::HeaderName::from_bytes(k.as_bytes()),
            aws_lambda_events::http::HeaderValue::from_str(v),
        ) {
            out.headers.insert(name, value);
        }
    }
    out.body = Some(Body::Text(r.body));
    serde_json::to_value(out).expect("response serialises")
}

//! The clock check's evidence from DynamoDB: the `Date` header of every answer, recorded with
//! the instants the request was sent and the answer received (see `crate::clock`). Time is read
//! through the clock module only.
//!
//! It is taken where the request meets the wire: a wrapper around the SDK client's HTTP
//! client, whose connector notes the instant before handing a request on and reads the `Date`
//! of the answer's head as it comes back. An SDK interceptor saw the same, but every
//! interceptor is asked about each of about twenty points of every request, each question a
//! look-up in the request's configuration, and its sent instant went through that
//! configuration as well: about a tenth of what leasehold's M1 cycle cost above the bare SDK
//! pair's (BENCHMARKS.md, "M1").

use std::sync::Arc;

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::connector_metadata::ConnectorMetadata;
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpClient, SharedHttpConnector,
};
use aws_smithy_runtime_api::client::orchestrator::HttpRequest;
use aws_smithy_runtime_api::client::runtime_components::{RuntimeComponents, RuntimeComponentsBuilder};
use aws_smithy_types::config_bag::ConfigBag;
use aws_smithy_types::date_time::{DateTime, Format as DateFormat};

use crate::clock::{Clock, ClockSamples, Sample, SystemClock};

/// An HTTP client that records the `Date` of every answer into its [`ClockSamples`]; the
/// connections, TLS and everything else are the wrapped client's.
#[derive(Debug, Clone)]
pub(super) struct DateSampling {
    inner: SharedHttpClient,
    samples: Arc<ClockSamples>,
}

impl DateSampling {
    pub(super) fn new(inner: SharedHttpClient, samples: Arc<ClockSamples>) -> Self {
        DateSampling { inner, samples }
    }
}

impl HttpClient for DateSampling {
    fn http_connector(&self, settings: &HttpConnectorSettings, components: &RuntimeComponents) -> SharedHttpConnector {
        SharedHttpConnector::new(Sampled {
            inner: self.inner.http_connector(settings, components),
            samples: self.samples.clone(),
        })
    }

    fn validate_base_client_config(
        &self,
        components: &RuntimeComponentsBuilder,
        cfg: &ConfigBag,
    ) -> Result<(), BoxError> {
        HttpClient::validate_base_client_config(&self.inner, components, cfg)
    }

    fn validate_final_config(&self, components: &RuntimeComponents, cfg: &ConfigBag) -> Result<(), BoxError> {
        self.inner.validate_final_config(components, cfg)
    }

    fn connector_metadata(&self) -> Option<ConnectorMetadata> {
        self.inner.connector_metadata()
    }
}

/// One connector of [`DateSampling`].
#[derive(Debug)]
struct Sampled {
    inner: SharedHttpConnector,
    samples: Arc<ClockSamples>,
}

impl HttpConnector for Sampled {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        // Before the request is handed on: no later than it is sent (an earlier instant only
        // widens the sample's interval).
        let sent = SystemClock.now();
        let answer = self.inner.call(request);
        let samples = self.samples.clone();
        HttpConnectorFuture::new(async move {
            let response = answer.await?;
            let received = SystemClock.now();
            let date = response.headers().get("date").and_then(|d| DateTime::from_str(d, DateFormat::HttpDate).ok());
            if let Some(date) = date.filter(|d| d.secs() > 0) {
                samples.record(Sample::dated(sent, received, date.secs() as u64));
            }
            Ok(response)
        })
    }
}

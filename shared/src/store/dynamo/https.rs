//! The HTTPS client of every SDK client: rustls on ring, with the platform's trust store
//! loaded when it is first needed instead of whenever an SDK client is built.
//!
//! The SDK's own HTTPS client loads the trust store (every certificate file of the platform,
//! parsed) in `validate_base_client_config`, which runs each time a client is built: a
//! Lambda function built three or four clients before asking for its first event, each
//! parsing the roots again, and most of its time before ready went there (BENCHMARKS.md,
//! "Cold start"). [`DeferredTrust`] leaves that out, so the roots are loaded once, when the
//! first connection is made (the connectors, the roots and the verification are the SDK's,
//! unchanged). Reading them ahead on a thread of its own, once the function had asked for its
//! first event, was measured too and left out: the thread ran beside the runtime client's
//! start and put back most of the ready time it had saved, without shortening ready plus
//! first event (BENCHMARKS.md, "Cold start").

use aws_smithy_http_client::tls;
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::connector_metadata::ConnectorMetadata;
use aws_smithy_runtime_api::client::http::{HttpClient, HttpConnectorSettings, SharedHttpClient, SharedHttpConnector};
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::ConfigBag;

/// The SDK's HTTPS client (rustls, ring) without its eager trust-store load.
#[derive(Debug, Clone)]
pub(crate) struct DeferredTrust(SharedHttpClient);

impl DeferredTrust {
    pub(crate) fn new() -> Self {
        DeferredTrust(
            aws_smithy_http_client::Builder::new()
                .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring))
                .build_https(),
        )
    }

    /// A new one, shared as an SDK configuration's HTTP client.
    pub(crate) fn shared() -> SharedHttpClient {
        SharedHttpClient::new(DeferredTrust::new())
    }
}

impl HttpClient for DeferredTrust {
    fn http_connector(&self, settings: &HttpConnectorSettings, components: &RuntimeComponents) -> SharedHttpConnector {
        self.0.http_connector(settings, components)
    }

    // `validate_base_client_config` keeps the trait's default (nothing): the inner client's
    // would load the trust store each time a client is built.

    fn validate_final_config(&self, components: &RuntimeComponents, cfg: &ConfigBag) -> Result<(), BoxError> {
        self.0.validate_final_config(components, cfg)
    }

    fn connector_metadata(&self) -> Option<ConnectorMetadata> {
        self.0.connector_metadata()
    }
}

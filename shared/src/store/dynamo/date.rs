//! The clock check's evidence from DynamoDB: an SDK interceptor that records the `Date` header
//! of every answer with the instants the request was sent and the answer received (see
//! `crate::clock`). Time is read through the clock module only.

use std::sync::Arc;
use std::time::Instant;

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::{ConfigBag, Storable, StoreReplace};
use aws_smithy_types::date_time::{DateTime, Format as DateFormat};

use crate::clock::{Clock, ClockSamples, Sample, SystemClock};

/// Records the `Date` of every DynamoDB answer into its [`ClockSamples`].
#[derive(Debug)]
pub(super) struct DateSampler(pub(super) Arc<ClockSamples>);

/// When the request was sent, kept in the request's config bag until its answer comes.
#[derive(Debug, Clone, Copy)]
struct SentAt(Instant);

impl Storable for SentAt {
    type Storer = StoreReplace<Self>;
}

impl Intercept for DateSampler {
    fn name(&self) -> &'static str {
        "leasehold-date-sampler"
    }

    fn read_before_transmit(
        &self,
        _: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> std::result::Result<(), BoxError> {
        cfg.interceptor_state().store_put(SentAt(SystemClock.now()));
        Ok(())
    }

    fn read_after_transmit(
        &self,
        ctx: &BeforeDeserializationInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> std::result::Result<(), BoxError> {
        let received = SystemClock.now();
        let date = ctx.response().headers().get("date").and_then(|d| DateTime::from_str(d, DateFormat::HttpDate).ok());
        if let (Some(SentAt(sent)), Some(date)) = (cfg.load::<SentAt>().copied(), date) {
            if date.secs() > 0 {
                self.0.record(Sample { sent, received, date_s: date.secs() as u64 });
            }
        }
        Ok(())
    }
}

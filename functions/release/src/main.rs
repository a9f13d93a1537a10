//! The release Lambda function: direct invoke, HTTP API and (heartbeat) scheduled events.
//! All logic lives in the leasehold crate; see `leasehold::lambda`.

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    leasehold::lambda::run(leasehold::lambda::Function::Release).await
}

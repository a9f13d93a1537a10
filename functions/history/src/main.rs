//! The history Lambda function: DynamoDB Streams records of the lease table into the history
//! table (DESIGN.md, "Lease history"). All logic lives in the leasehold crate.

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    leasehold::lambda::history::run().await
}

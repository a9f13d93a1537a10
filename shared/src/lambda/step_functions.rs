//! Step Functions as the functions see it: which executions ended (the keep-alive sweep), and
//! the queue's deliveries (`SendTaskSuccess`, `SendTaskFailure`).

use super::*;

/// Step Functions DescribeExecution as an [`Executions`] source.
pub struct StepFunctions(pub aws_sdk_sfn::Client);

#[async_trait]
impl Executions for StepFunctions {
    async fn state(&self, execution_arn: &str) -> ExecutionState {
        use aws_sdk_sfn::types::ExecutionStatus;
        match self.0.describe_execution().execution_arn(execution_arn).send().await {
            Ok(out) => match out.status() {
                ExecutionStatus::Running | ExecutionStatus::PendingRedrive => ExecutionState::Running,
                ExecutionStatus::Succeeded
                | ExecutionStatus::Failed
                | ExecutionStatus::TimedOut
                | ExecutionStatus::Aborted => ExecutionState::Ended,
                _ => ExecutionState::Unknown,
            },
            Err(e) => {
                let gone = e.as_service_error().is_some_and(|s| s.is_execution_does_not_exist());
                if gone {
                    ExecutionState::Ended
                } else {
                    tracing::warn!(error = %aws_smithy_types::error::display::DisplayErrorContext(&e), "DescribeExecution failed");
                    ExecutionState::Unknown
                }
            }
        }
    }
}

/// Step Functions ListExecutions (RUNNING, 1,000 a page) as the sweep's lists.
#[async_trait]
impl executions::RunningExecutions for StepFunctions {
    async fn running_page(
        &self,
        state_machine_arn: &str,
        next: Option<String>,
    ) -> Result<(Vec<String>, Option<String>), String> {
        let out = self
            .0
            .list_executions()
            .state_machine_arn(state_machine_arn)
            .status_filter(aws_sdk_sfn::types::ExecutionStatus::Running)
            .max_results(1000)
            .set_next_token(next)
            .send()
            .await
            .map_err(|e| aws_smithy_types::error::display::DisplayErrorContext(&e).to_string())?;
        let arns = out.executions().iter().map(|e| e.execution_arn().to_string()).collect();
        Ok((arns, out.next_token().map(str::to_string)))
    }
}

/// Step Functions `SendTaskSuccess` / `SendTaskFailure` as the queue's delivery.
#[async_trait]
impl crate::queue::Deliver for StepFunctions {
    async fn success(&self, token: &str, lease: &crate::model::Lease) -> Result<(), crate::queue::DeliveryError> {
        let output = serde_json::to_string(lease).expect("lease serialises");
        let res = self.0.send_task_success().task_token(token).output(output).send().await;
        res.map(|_| ()).map_err(|e| {
            let gone = e
                .as_service_error()
                .is_some_and(|s| s.is_task_does_not_exist() || s.is_task_timed_out() || s.is_invalid_token());
            delivery_error(gone, &e)
        })
    }

    async fn failure(&self, token: &str, error: &str, cause: &str) -> Result<(), crate::queue::DeliveryError> {
        let res = self.0.send_task_failure().task_token(token).error(error).cause(cause).send().await;
        res.map(|_| ()).map_err(|e| {
            let gone = e
                .as_service_error()
                .is_some_and(|s| s.is_task_does_not_exist() || s.is_task_timed_out() || s.is_invalid_token());
            delivery_error(gone, &e)
        })
    }
}

pub(super) fn delivery_error(gone: bool, e: &dyn std::error::Error) -> crate::queue::DeliveryError {
    let msg = aws_smithy_types::error::display::DisplayErrorContext(e).to_string();
    if gone {
        crate::queue::DeliveryError::Gone(msg)
    } else {
        crate::queue::DeliveryError::Transient(msg)
    }
}

//! `sandcell-worker`: runs execution jobs in capped Docker sandboxes. Configuration by
//! environment variables (see `docs/configuration.md`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    sandcell_core::telemetry::init_tracing();
    let result = async { sandcell_worker::run(sandcell_worker::Config::from_env()?).await }.await;
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "worker stopped");
            std::process::ExitCode::FAILURE
        }
    }
}

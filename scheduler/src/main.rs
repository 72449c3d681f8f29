//! `sandcell-scheduler`: intake and scheduling. Configuration by environment variables
//! (see `docs/configuration.md`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    sandcell_core::telemetry::init_tracing();
    let result = async { sandcell_scheduler::run(sandcell_scheduler::Config::from_env()?).await }.await;
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "scheduler stopped");
            std::process::ExitCode::FAILURE
        }
    }
}

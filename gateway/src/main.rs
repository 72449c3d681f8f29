//! `sandcell-gateway`: see the crate's documentation (`lib.rs`) and docs/e2b-compatibility.md.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    sandcell_core::telemetry::init_tracing();
    let settings = sandcell_gateway::config::Settings::from_env()?;
    let gw = sandcell_gateway::Gateway::connect(settings).await?;
    sandcell_gateway::serve(gw).await
}

//! `sandcell`: submit code and read results from the command line.
//!
//! ```text
//! sandcell run --tenant demo --code 'print(1+1)'
//! sandcell run --tenant demo --code-file job.py --file data.csv --timeout-ms 10000
//! sandcell result --tenant demo JOB_ID
//! sandcell artifact-url --tenant demo JOB_ID chart.png
//! ```
//! Connection settings come from `SANDCELL_AMQP_URL` and `SANDCELL_DATABASE_URL`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use base64::Engine as _;
use clap::{Parser, Subcommand};
use sandcell_client::Client;
use sandcell_protocol::{InputFile, Language, Submission};

#[derive(Parser)]
#[command(name = "sandcell", about = "Submit code to sandcell and read results")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Submit code, wait for the result and print it as JSON.
    Run {
        /// Tenant.
        #[arg(long, env = "SANDCELL_TENANT", default_value = "demo")]
        tenant: String,
        /// Job id (idempotency key); a random one by default.
        #[arg(long)]
        job_id: Option<String>,
        /// `python` or `bash`.
        #[arg(long, default_value = "python")]
        language: String,
        /// The code.
        #[arg(long, conflicts_with = "code_file")]
        code: Option<String>,
        /// A file holding the code.
        #[arg(long)]
        code_file: Option<PathBuf>,
        /// Input file: `LOCAL` or `LOCAL:REMOTE` (REMOTE relative to /home/user). Repeatable.
        #[arg(long = "file")]
        files: Vec<String>,
        /// Wall-clock timeout in milliseconds.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Memory limit in MiB.
        #[arg(long)]
        memory_mb: Option<u64>,
        /// Artifact TTL in seconds.
        #[arg(long)]
        artifact_ttl_s: Option<u64>,
        /// How long to wait for the result.
        #[arg(long, default_value_t = 300)]
        wait_s: u64,
    },
    /// Print a job's current result.
    Result {
        /// Tenant.
        #[arg(long, env = "SANDCELL_TENANT", default_value = "demo")]
        tenant: String,
        /// Job id.
        job_id: String,
    },
    /// Print an artifact's download URL (fails with artifact_expired after its TTL).
    ArtifactUrl {
        /// Tenant.
        #[arg(long, env = "SANDCELL_TENANT", default_value = "demo")]
        tenant: String,
        /// Job id.
        job_id: String,
        /// Artifact path.
        path: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sandcell: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let client = Client::from_env().await?;
    match cli.command {
        Command::Run { tenant, job_id, language, code, code_file, files, timeout_ms, memory_mb, artifact_ttl_s, wait_s } => {
            let code = match (code, code_file) {
                (Some(c), _) => c,
                (None, Some(p)) => std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?,
                (None, None) => anyhow::bail!("give --code or --code-file"),
            };
            let language = match language.as_str() {
                "python" => Language::Python,
                "bash" => Language::Bash,
                other => anyhow::bail!("unknown language {other:?}: use python or bash"),
            };
            let files = files.iter().map(|spec| read_input(spec)).collect::<anyhow::Result<Vec<_>>>()?;
            let job_id = job_id.unwrap_or_else(|| format!("cli-{}", uuid::Uuid::new_v4()));
            let sub = Submission { job_id: job_id.clone(), tenant: tenant.clone(), language, code, files, timeout_ms, memory_mb, cpus: None, artifact_ttl_s, session: None };
            client.submit(&sub).await?;
            let result = client.wait(&tenant, &job_id, Duration::from_secs(wait_s)).await?;
            println!("{}", serde_json::to_string_pretty(&result)?);
            Ok(if result.status == sandcell_protocol::JobStatus::Succeeded { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Result { tenant, job_id } => match client.result(&tenant, &job_id).await? {
            Some(r) => {
                println!("{}", serde_json::to_string_pretty(&r)?);
                Ok(ExitCode::SUCCESS)
            }
            None => anyhow::bail!("no job {job_id:?} for tenant {tenant:?}"),
        },
        Command::ArtifactUrl { tenant, job_id, path } => {
            println!("{}", client.artifact_url(&tenant, &job_id, &path).await?);
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn read_input(spec: &str) -> anyhow::Result<InputFile> {
    let (local, remote) = match spec.split_once(':') {
        Some((l, r)) => (l.to_string(), r.to_string()),
        None => {
            let name = std::path::Path::new(spec).file_name().context("input file has no name")?.to_string_lossy().into_owned();
            (spec.to_string(), name)
        }
    };
    let bytes = std::fs::read(&local).with_context(|| format!("reading {local}"))?;
    Ok(InputFile { path: remote, content_b64: base64::engine::general_purpose::STANDARD.encode(bytes) })
}

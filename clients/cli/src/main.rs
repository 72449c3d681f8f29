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
use clap::{Parser, Subcommand};
use sandcell_client::Client;
use sandcell_protocol::{InputFile, Language, SessionRequest, Submission};

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
        /// `new` to open a session with this job, or the id of a session to run in.
        #[arg(long)]
        session: Option<String>,
        /// With `--session new`: keep-alive in seconds.
        #[arg(long)]
        keep_alive_s: Option<u64>,
        /// With `--session <id>`: close the session after this job.
        #[arg(long)]
        close: bool,
        /// Workspace file to return as an artifact after the code ran. Repeatable.
        #[arg(long = "get-file")]
        get_files: Vec<String>,
        /// Return a listing of the workspace after the code ran.
        #[arg(long)]
        list_files: bool,
    },
    /// Print a session's current state.
    Session {
        /// Tenant.
        #[arg(long, env = "SANDCELL_TENANT", default_value = "demo")]
        tenant: String,
        /// Session id.
        session_id: String,
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
        Command::Run {
            tenant,
            job_id,
            language,
            code,
            code_file,
            files,
            timeout_ms,
            memory_mb,
            artifact_ttl_s,
            wait_s,
            session,
            keep_alive_s,
            close,
            get_files,
            list_files,
        } => {
            let code = match (code, code_file) {
                (Some(c), _) => c,
                (None, Some(p)) => std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?,
                (None, None) => String::new(),
            };
            let language = match language.as_str() {
                "python" => Language::Python,
                "bash" => Language::Bash,
                other => anyhow::bail!("unknown language {other:?}: use python or bash"),
            };
            let files = files.iter().map(|spec| read_input(spec)).collect::<anyhow::Result<Vec<_>>>()?;
            let job_id = job_id.unwrap_or_else(|| format!("cli-{}", uuid::Uuid::new_v4()));
            let mut sub = Submission::new(tenant.clone(), job_id.clone(), language, code);
            sub.files = files;
            sub.timeout_ms = timeout_ms;
            sub.memory_mb = memory_mb;
            sub.artifact_ttl_s = artifact_ttl_s;
            sub.get_files = get_files;
            sub.list_files = list_files;
            sub.session = session.map(|s| match s.as_str() {
                "new" => SessionRequest { new: true, keep_alive_s, ..Default::default() },
                id => SessionRequest { id: Some(id.to_string()), close, ..Default::default() },
            });
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
        Command::Session { tenant, session_id } => match client.session(&tenant, &session_id).await? {
            Some(s) => {
                println!("{}", serde_json::to_string_pretty(&s)?);
                Ok(ExitCode::SUCCESS)
            }
            None => anyhow::bail!("tenant {tenant:?} has no session {session_id:?}"),
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
    Ok(InputFile::inline(remote, &bytes))
}

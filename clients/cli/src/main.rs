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
    /// Submit code, show its output on stderr as it runs, wait for the result and print it as
    /// JSON on stdout.
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
        /// Do not show the job's output on stderr while it runs (the result, printed at the
        /// end, holds all of it either way).
        #[arg(long)]
        no_live: bool,
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
            no_live,
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
            // Subscribed before the submission: events are not kept for late subscribers.
            let live = if no_live {
                None
            } else {
                match client.live(&tenant, Some(&job_id)).await {
                    Ok(live) => Some(tokio::spawn(show_live(live))),
                    Err(e) => {
                        eprintln!("sandcell: no live output ({e:#}); the result follows at the end");
                        None
                    }
                }
            };
            client.submit(&sub).await?;
            let result = client.wait(&tenant, &job_id, Duration::from_secs(wait_s)).await?;
            if let Some(task) = live {
                // The end event follows the commit the wait saw; a lost one costs a second.
                if tokio::time::timeout(Duration::from_secs(1), task).await.is_err() {
                    eprintln!("sandcell: (live output incomplete; the result below is complete)");
                }
            }
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

/// Print a job's live output on stderr until its `end` event.
async fn show_live(mut live: sandcell_client::LiveOutput) {
    use sandcell_protocol::EventBody;
    use std::io::Write;
    let (mut attempt, mut expected) = (0, 0);
    while let Some(event) = live.next().await {
        let mut err = std::io::stderr().lock();
        if event.attempt != attempt {
            // The job runs again (its worker died): its output starts over.
            if attempt != 0 {
                let _ = writeln!(err, "[sandcell: the job runs again (attempt {})]", event.attempt);
            }
            (attempt, expected) = (event.attempt, 0);
        }
        if event.seq != expected {
            let _ = writeln!(err, "[sandcell: {} live event(s) missed]", event.seq.saturating_sub(expected));
        }
        expected = event.seq + 1;
        let _ = match &event.body {
            EventBody::Stdout { text } | EventBody::Stderr { text } => write!(err, "{text}"),
            EventBody::Output { data, omitted, .. } => {
                let images: Vec<&String> = data.keys().chain(omitted).filter(|m| m.starts_with("image/")).collect();
                match (images.is_empty(), data.get("text/plain")) {
                    (true, Some(text)) => writeln!(err, "{text}"),
                    _ => writeln!(err, "[{}: in the result's artifacts]", images.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ")),
                }
            }
            EventBody::Error { traceback, .. } => writeln!(err, "{}", traceback.join("\n")),
            EventBody::End { .. } => return,
        };
        let _ = err.flush();
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

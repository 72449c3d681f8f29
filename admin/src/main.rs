//! `sandcell-admin`: operator commands. See `docs/security.md` ("Tenants").
//!
//! ```text
//! sandcell-admin tenant create acme [--max-sessions 20] [--max-queued-jobs 1000] [--max-artifact-bytes N] [--max-jobs-in-flight 4]
//! sandcell-admin tenant quotas acme --max-sessions 5
//! sandcell-admin tenant show acme
//! ```
//! `create` prints the tenant's `SANDCELL_AMQP_URL` and `SANDCELL_DATABASE_URL` as env lines;
//! running it again for an existing tenant rotates both credentials.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use sandcell_admin::{Admin, AdminSettings};
use sandcell_core::tenants::Quotas;

#[derive(Parser)]
#[command(name = "sandcell-admin", about = "sandcell operator commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Manage tenants.
    #[command(subcommand)]
    Tenant(TenantCommand),
}

#[derive(Subcommand)]
enum TenantCommand {
    /// Create a tenant (or rotate its credentials) and print its connection URLs.
    Create {
        /// Tenant name: 1-64 of [a-z0-9_-].
        name: String,
        #[command(flatten)]
        quotas: QuotaArgs,
    },
    /// Change a tenant's quotas (unset ones keep their value).
    Quotas {
        /// Tenant name.
        name: String,
        #[command(flatten)]
        quotas: QuotaArgs,
    },
    /// Set a tenant's broker permissions to what this version grants (e.g. live output for a
    /// tenant created before it existed), keeping its credentials.
    Permissions {
        /// Tenant name.
        name: String,
    },
    /// List every registered tenant with its quotas.
    List,
    /// Take a tenant's access away: delete its broker user and database login and set its
    /// session and job quotas to zero. Its results and artifacts stay until they expire;
    /// `tenant create` gives it new credentials later (with quotas to set again).
    Delete {
        /// Tenant name.
        name: String,
    },
    /// Print a tenant's quotas.
    Show {
        /// Tenant name.
        name: String,
    },
}

#[derive(Args)]
struct QuotaArgs {
    /// Sessions starting or active at once.
    #[arg(long)]
    max_sessions: Option<u32>,
    /// Jobs queued or running at once.
    #[arg(long)]
    max_queued_jobs: Option<u32>,
    /// Bytes of artifacts stored at once.
    #[arg(long)]
    max_artifact_bytes: Option<u64>,
    /// One-off and session-opening jobs dispatched to workers at once (fair share); more wait
    /// in Postgres, in order.
    #[arg(long)]
    max_jobs_in_flight: Option<u32>,
}

impl QuotaArgs {
    fn over(&self, base: Quotas) -> Quotas {
        Quotas {
            max_sessions: self.max_sessions.unwrap_or(base.max_sessions),
            max_queued_jobs: self.max_queued_jobs.unwrap_or(base.max_queued_jobs),
            max_artifact_bytes: self.max_artifact_bytes.unwrap_or(base.max_artifact_bytes),
            max_jobs_in_flight: self.max_jobs_in_flight.unwrap_or(base.max_jobs_in_flight).max(1),
        }
    }
}

fn print_quotas(name: &str, q: &Quotas) {
    println!(
        "tenant {name}: max_sessions={} max_queued_jobs={} max_artifact_bytes={} max_jobs_in_flight={}",
        q.max_sessions, q.max_queued_jobs, q.max_artifact_bytes, q.max_jobs_in_flight
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let admin = Admin::connect(AdminSettings::from_env()?).await?;
    let defaults = Quotas::from_env()?;
    match cli.command {
        Command::Tenant(TenantCommand::Create { name, quotas }) => {
            let base = admin.quotas(&name).await?.unwrap_or(defaults);
            let creds = admin.create_tenant(&name, &quotas.over(base)).await?;
            println!("SANDCELL_TENANT={}", creds.tenant);
            println!("SANDCELL_AMQP_URL={}", creds.amqp_url);
            println!("SANDCELL_DATABASE_URL={}", creds.database_url);
        }
        Command::Tenant(TenantCommand::Quotas { name, quotas }) => {
            let base = admin.quotas(&name).await?.unwrap_or(defaults);
            let q = quotas.over(base);
            admin.set_quotas(&name, &q).await?;
            print_quotas(&name, &q);
        }
        Command::Tenant(TenantCommand::Permissions { name }) => {
            admin.grant_broker_permissions(&name).await?;
            println!("tenant {name}: broker permissions set");
        }
        Command::Tenant(TenantCommand::List) => {
            for (name, q, login) in admin.list_tenants().await? {
                print_quotas(&name, &q);
                if !login {
                    println!("  (no database login: deleted, or only ever used through a trusted backend)");
                }
            }
        }
        Command::Tenant(TenantCommand::Delete { name }) => {
            if !admin.delete_tenant(&name).await? {
                anyhow::bail!("no tenant {name:?}");
            }
            println!("tenant {name}: broker user and database login deleted, quotas zero");
        }
        Command::Tenant(TenantCommand::Show { name }) => {
            let q = admin.quotas(&name).await?.with_context(|| format!("no tenant {name:?}"))?;
            print_quotas(&name, &q);
        }
    }
    Ok(())
}

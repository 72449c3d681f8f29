//! `sqlx::migrate!` embeds `migrations/` at compile time; without this, adding a migration
//! would not rebuild the crate, and binaries would run without it.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}

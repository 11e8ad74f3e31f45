//! Copies the dashboard's third-party browser code (xterm.js, pinned by
//! `dashboard/package-lock.json` and installed by `scripts/setup` with
//! `npm ci`) into the build, so the binary carries it. Without it the build
//! still succeeds: the dashboard then says its terminal is missing and how to
//! add it, and everything else works.

use std::path::Path;
use std::{env, fs};

/// What is embedded: (installed path under `dashboard/node_modules`, name in OUT_DIR).
const VENDORED: &[(&str, &str)] = &[
    ("@xterm/xterm/lib/xterm.js", "xterm.js"),
    ("@xterm/xterm/css/xterm.css", "xterm.css"),
];

fn main() {
    let out = env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let modules = Path::new("dashboard/node_modules");
    println!("cargo:rerun-if-changed=dashboard/package-lock.json");
    for (installed, name) in VENDORED {
        let from = modules.join(installed);
        println!("cargo:rerun-if-changed={}", from.display());
        let bytes = fs::read(&from).unwrap_or_else(|_| {
            println!(
                "cargo:warning=dashboard: {} is not installed (run scripts/setup, or npm ci in crates/api/dashboard); the web terminal is left out",
                from.display()
            );
            Vec::new()
        });
        fs::write(Path::new(&out).join(name), bytes).expect("OUT_DIR is writable");
    }
}

//! Node tools of the default image that Debian bookworm does not package:
//! TypeScript's language server (for the agent's `/lsp/*`) and TypeScript
//! itself, which the server runs (`tsserver`).
//!
//! Each is an npm tarball fetched from the registry at image build time,
//! pinned by version and by the registry's `sha512` integrity, checked
//! before a byte is unpacked. They are laid out as `npm install -g` would:
//! `/usr/local/lib/node_modules/<name>` and a link in `/usr/local/bin`, so
//! the server finds `typescript` as its sibling. No npm runs in the image,
//! and both packages have no dependencies (typescript-language-server 4.x
//! ships bundled), so nothing else is fetched.

use std::io::Read as _;
use std::path::{Component, Path, PathBuf};

use base64::Engine as _;
use sha2::{Digest as _, Sha512};

use crate::error::{io_err, ImageError, Result};

/// One pinned npm package.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NpmPackage {
    pub name: &'static str,
    pub version: &'static str,
    /// The registry's `dist.integrity` (`npm view NAME@VERSION dist.integrity`).
    pub integrity: &'static str,
    /// Programs linked into `/usr/local/bin`: (name, path in the package).
    pub bin: &'static [(&'static str, &'static str)],
}

/// What the default image gets from npm. typescript stays on 5.x: 7 is the
/// native rewrite, without the `tsserver` typescript-language-server drives.
pub(crate) const NPM_PACKAGES: &[NpmPackage] = &[
    NpmPackage {
        name: "typescript-language-server",
        version: "4.4.1",
        integrity: "sha512-vEvDw+cjY75afMN2rhx0z8sQtFDAUHoBniksBmB6NUZlDt0rEIwQq01VMiqyXFm9uZwcED2475cmDeXxoDHleg==",
        bin: &[("typescript-language-server", "lib/cli.mjs")],
    },
    NpmPackage {
        name: "typescript",
        version: "5.9.3",
        integrity: "sha512-jl1vZzPDinLr9eUt3J/t7V6FgNEw9QjvBPdysz9KfQDD41fQrC2Y4vKQdiaUpFT4bXlb1RHhLpp8wtm6M5TgSw==",
        bin: &[("tsc", "bin/tsc"), ("tsserver", "bin/tsserver")],
    },
];

const DEFAULT_REGISTRY: &str = "https://registry.npmjs.org";
/// Largest tarball read (typescript 5.9 is about 4 MiB); the registry is not
/// trusted to stop.
const MAX_TARBALL_BYTES: u64 = 64 << 20;

impl NpmPackage {
    /// The tarball's URL on `registry` (npm's layout: `NAME/-/NAME-VERSION.tgz`).
    pub(crate) fn tarball_url(&self, registry: &str) -> String {
        format!(
            "{}/{name}/-/{name}-{version}.tgz",
            registry.trim_end_matches('/'),
            name = self.name,
            version = self.version
        )
    }

    fn label(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// Whether `tarball` is what the pinned integrity says.
    fn verify(&self, tarball: &[u8]) -> Result<()> {
        let expected = self
            .integrity
            .strip_prefix("sha512-")
            .expect("pinned integrities are sha512");
        let actual = base64::engine::general_purpose::STANDARD.encode(Sha512::digest(tarball));
        if actual != expected {
            return Err(ImageError::NpmIntegrity {
                package: self.label(),
                expected: self.integrity.to_owned(),
                actual: format!("sha512-{actual}"),
            });
        }
        Ok(())
    }
}

/// Fetches, verifies and unpacks every package of [`NPM_PACKAGES`] into
/// `rootfs`. Blocking. `COVE_NPM_REGISTRY` names a mirror (as
/// `COVE_DEBIAN_MIRROR` does for debootstrap).
pub(crate) fn install_npm_tools(rootfs: &Path) -> Result<()> {
    let registry = std::env::var("COVE_NPM_REGISTRY")
        .ok()
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| DEFAULT_REGISTRY.into());
    for package in NPM_PACKAGES {
        let tarball = fetch(&package.tarball_url(&registry), &registry, package)?;
        package.verify(&tarball)?;
        unpack(package, &tarball, rootfs)?;
    }
    Ok(())
}

/// Downloads on a thread of its own with its own runtime: the caller may be
/// on a blocking thread of another runtime, where blocking on one is refused.
fn fetch(url: &str, registry: &str, package: &NpmPackage) -> Result<Vec<u8>> {
    let unreachable = |detail: String| ImageError::Unreachable {
        registry: registry.to_owned(),
        detail: format!("fetching {}: {detail}", package.label()),
    };
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| unreachable(format!("starting a runtime: {e}")))?;
                runtime.block_on(async {
                    crate::registry::install_tls_provider();
                    let mut response = reqwest::Client::new()
                        .get(url)
                        .send()
                        .await
                        .and_then(reqwest::Response::error_for_status)
                        .map_err(|e| unreachable(crate::registry::error_chain(&e)))?;
                    let mut body = Vec::new();
                    while let Some(chunk) = response
                        .chunk()
                        .await
                        .map_err(|e| unreachable(crate::registry::error_chain(&e)))?
                    {
                        body.extend_from_slice(&chunk);
                        if body.len() as u64 > MAX_TARBALL_BYTES {
                            return Err(unreachable(format!(
                                "the tarball is over {} MiB",
                                MAX_TARBALL_BYTES >> 20
                            )));
                        }
                    }
                    Ok(body)
                })
            })
            .join()
            .unwrap_or_else(|_| Err(unreachable("the download thread panicked".into())))
    })
}

/// Unpacks a verified tarball as `/usr/local/lib/node_modules/NAME` (its
/// entries' first component, `package/` by npm's convention, dropped) and
/// links its programs into `/usr/local/bin`.
fn unpack(package: &NpmPackage, tarball: &[u8], rootfs: &Path) -> Result<()> {
    let modules = rootfs.join("usr/local/lib/node_modules");
    let target = modules.join(package.name);
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(io_err(&target, "remove"))?;
    }
    std::fs::create_dir_all(&target).map_err(io_err(&target, "create"))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(tarball));
    let entries = archive
        .entries()
        .map_err(io_err(&target, "read the npm tarball for"))?;
    for entry in entries {
        let mut entry = entry.map_err(io_err(&target, "read the npm tarball for"))?;
        let name = entry
            .path()
            .map_err(io_err(&target, "read an entry name for"))?
            .into_owned();
        let Some(relative) = inside_package(&name) else {
            continue;
        };
        let dest = target.join(&relative);
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            std::fs::create_dir_all(&dest).map_err(io_err(&dest, "create"))?;
        } else if kind.is_file() {
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent).map_err(io_err(parent, "create"))?;
            }
            let mut data = Vec::new();
            entry
                .read_to_end(&mut data)
                .map_err(io_err(&dest, "read from the tarball"))?;
            std::fs::write(&dest, &data).map_err(io_err(&dest, "write"))?;
            let mode = (entry.header().mode().unwrap_or(0o644) & 0o755) | 0o644;
            set_mode(&dest, mode)?;
        }
        // npm tarballs hold files and directories only; anything else
        // (links, devices) is not installed.
    }
    let bin = rootfs.join("usr/local/bin");
    std::fs::create_dir_all(&bin).map_err(io_err(&bin, "create"))?;
    for (program, script) in package.bin {
        let script_path = target.join(script);
        // As npm does: the linked script is executable whatever the tarball said.
        set_mode(&script_path, 0o755)?;
        let link = bin.join(program);
        let _ = std::fs::remove_file(&link);
        let relative = Path::new("../lib/node_modules")
            .join(package.name)
            .join(script);
        std::os::unix::fs::symlink(&relative, &link).map_err(io_err(&link, "link"))?;
    }
    Ok(())
}

/// An entry's path below the package directory: the first component dropped,
/// `None` for the top directory itself or a path that would leave it.
fn inside_package(name: &Path) -> Option<PathBuf> {
    let mut components = name.components();
    if !matches!(components.next(), Some(Component::Normal(_))) {
        return None;
    }
    let rest: PathBuf = components.clone().collect();
    let safe = components.all(|c| matches!(c, Component::Normal(_)));
    (safe && !rest.as_os_str().is_empty()).then_some(rest)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io_err(path, "set the mode of"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gzipped tar as npm packs one: everything under `package/`.
    fn tarball(entries: &[(&str, &[u8], u32)]) -> Vec<u8> {
        let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        ));
        for (path, data, mode) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(*mode);
            header.set_entry_type(tar::EntryType::Regular);
            builder.append_data(&mut header, path, *data).unwrap();
        }
        builder.into_inner().unwrap().finish().unwrap()
    }

    fn integrity(bytes: &[u8]) -> &'static str {
        let hash = base64::engine::general_purpose::STANDARD.encode(Sha512::digest(bytes));
        Box::leak(format!("sha512-{hash}").into_boxed_str())
    }

    #[test]
    fn the_pins_are_sha512_and_the_urls_npms() {
        for package in NPM_PACKAGES {
            let hash = package.integrity.strip_prefix("sha512-").unwrap();
            assert_eq!(
                base64::engine::general_purpose::STANDARD
                    .decode(hash)
                    .unwrap()
                    .len(),
                64,
                "{}",
                package.name
            );
        }
        assert_eq!(
            NPM_PACKAGES[0].tarball_url("https://registry.npmjs.org/"),
            "https://registry.npmjs.org/typescript-language-server/-/typescript-language-server-4.4.1.tgz"
        );
    }

    #[test]
    fn a_tarball_is_unpacked_only_if_its_hash_is_the_pinned_one() {
        let bytes = tarball(&[
            ("package/package.json", b"{}", 0o644),
            ("package/lib/cli.mjs", b"#!/usr/bin/env node\n", 0o644),
        ]);
        let package = NpmPackage {
            name: "tool",
            version: "1.0.0",
            integrity: integrity(&bytes),
            bin: &[("tool", "lib/cli.mjs")],
        };
        package.verify(&bytes).unwrap();
        let mut tampered = bytes.clone();
        *tampered.last_mut().unwrap() ^= 1;
        let error = package.verify(&tampered).unwrap_err();
        assert!(error.to_string().contains("tool@1.0.0"), "{error}");

        let rootfs = tempfile::tempdir().unwrap();
        unpack(&package, &bytes, rootfs.path()).unwrap();
        let cli = rootfs
            .path()
            .join("usr/local/lib/node_modules/tool/lib/cli.mjs");
        assert_eq!(std::fs::read(&cli).unwrap(), b"#!/usr/bin/env node\n");
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(&cli).unwrap().permissions().mode() & 0o777,
            0o755
        );
        let link = rootfs.path().join("usr/local/bin/tool");
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            Path::new("../lib/node_modules/tool/lib/cli.mjs")
        );
        assert!(
            link.exists(),
            "the link resolves inside the root filesystem"
        );
    }

    #[test]
    fn entries_outside_the_package_directory_are_skipped() {
        for (name, inside) in [
            ("package/lib/a.js", Some("lib/a.js")),
            ("package", None),
            ("package/../../etc/passwd", None),
            ("/etc/passwd", None),
            ("other/x.js", Some("x.js")),
        ] {
            assert_eq!(
                inside_package(Path::new(name)),
                inside.map(PathBuf::from),
                "{name}"
            );
        }
    }
}

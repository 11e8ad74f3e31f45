//! Which way a VM starts, decided as a plain value before anything runs:
//! the facts are gathered first (a warm VM `prepare` took from the pool,
//! the saved memory's `machine.json`, the disk's size, what the sandbox
//! asks for), [`decide`] turns them into a [`VmStart`], and `boot` and
//! `pool` carry it out. Pure: no files, no processes; tested over every
//! branch below.

use super::qemu::Accelerator;
use super::saved::SavedMachine;
use crate::SandboxSpec;

/// What the sandbox asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Wanted {
    pub cpus: u32,
    pub memory_mib: u64,
    pub disk_bytes: u64,
    /// Whether it has volumes (virtio-fs shares, which QEMU cannot save).
    pub volumes: bool,
}

impl Wanted {
    /// What `spec` asks for (as its `Identity` tells the guest).
    pub(super) fn of(spec: &SandboxSpec) -> Wanted {
        Wanted {
            cpus: spec.resources.cpu.max(1),
            memory_mib: spec.resources.memory_mib,
            disk_bytes: spec.resources.disk_gib << 30,
            volumes: !spec.volumes.is_empty(),
        }
    }
}

/// What a start decides from. `W` is the warm VM a start may take (none
/// for the starts that never take one: templates, warm VMs, flushes).
#[derive(Debug)]
pub(super) struct StartFacts<'a, W> {
    pub id: &'a str,
    pub accelerator: Accelerator,
    /// A waiting VM of the pool that `prepare` took for this sandbox (its
    /// fit matched). With one, nothing else is read.
    pub warm: Option<W>,
    /// The saved memory's machine, where memory is saved (`state`, `ram`
    /// and `machine.json` all there).
    pub saved: Option<SavedMachine>,
    /// The root disk's size now; `None`: there is no disk.
    pub disk_bytes: Option<u64>,
    pub wanted: Wanted,
}

/// How a VM starts.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum VmStart<W> {
    /// Takes over the warm VM: its NIC plugged in, its identity told.
    Warm(W),
    /// A new QEMU continues the saved memory.
    Restore(Plan),
    /// A new QEMU boots from the disk, from zeroed memory.
    Cold(Plan),
}

/// The machine a new QEMU runs and what follows its launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub cpus: u32,
    pub memory_mib: u64,
    /// The size the disk grows to: before the launch for a cold boot, once
    /// the vCPUs run for a restore (only then is the disk writable).
    pub grow_disk_to: Option<u64>,
    /// Whether the agent is told who it is, and if so whether it grows its
    /// root file system. `None`: a sandbox resuming its own paused memory
    /// still is who it was (its clock came with the hello) and its disk
    /// did not grow.
    pub identity: Option<GrowRoot>,
}

/// Whether the guest grows its root file system to the disk.
pub(super) type GrowRoot = bool;

/// Why a VM cannot start as asked.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Its saved memory was saved under another layout or accelerator.
    Incompatible(String),
    /// Its memory is saved, but it has volumes: it must boot cold.
    Volumes,
    /// There is no disk to start from.
    NoDisk,
    /// Its disk is larger than asked for.
    Shrink { current: u64, wanted: u64 },
}

impl Refusal {
    /// What a user is told.
    pub(super) fn reason(&self) -> String {
        match self {
            Refusal::Incompatible(why) => format!("its saved memory cannot be restored: {why}"),
            Refusal::Volumes => "it has volumes, and a VM with volumes boots cold: its saved memory cannot be restored".to_owned(),
            Refusal::NoDisk => "it has no disk to start from".to_owned(),
            Refusal::Shrink { current, wanted } => format!(
                "its disk is {current} bytes, more than the {wanted} asked for; disks cannot shrink"
            ),
        }
    }
}

/// Decides how a VM starts: a warm VM taken is started as it is; saved
/// memory that fits this host is restored (the machine it was saved with,
/// whatever the spec says now); anything else boots cold. The disk only
/// ever grows.
pub(super) fn decide<W>(facts: StartFacts<'_, W>) -> Result<VmStart<W>, Refusal> {
    if let Some(warm) = facts.warm {
        return Ok(VmStart::Warm(warm));
    }
    let wanted = facts.wanted;
    if let Some(saved) = &facts.saved {
        if let Some(why) = saved.incompatibility(facts.accelerator) {
            return Err(Refusal::Incompatible(why));
        }
        if wanted.volumes {
            return Err(Refusal::Volumes);
        }
    }
    let current = facts.disk_bytes.ok_or(Refusal::NoDisk)?;
    if current > wanted.disk_bytes {
        return Err(Refusal::Shrink {
            current,
            wanted: wanted.disk_bytes,
        });
    }
    let grow_disk_to = (current < wanted.disk_bytes).then_some(wanted.disk_bytes);
    Ok(match facts.saved {
        Some(saved) => {
            let grow_root = grow_disk_to.is_some();
            let own_memory = saved.owner.as_deref() == Some(facts.id);
            VmStart::Restore(Plan {
                cpus: saved.cpus,
                memory_mib: saved.memory_mib,
                grow_disk_to,
                identity: (!own_memory || grow_root).then_some(grow_root),
            })
        }
        None => VmStart::Cold(Plan {
            cpus: wanted.cpus,
            memory_mib: wanted.memory_mib,
            grow_disk_to,
            identity: Some(true),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn wanted() -> Wanted {
        Wanted {
            cpus: 2,
            memory_mib: 1024,
            disk_bytes: 3 * GIB,
            volumes: false,
        }
    }

    /// Memory saved by a pause of `owner` (a copy has none), 1 CPU, 512 MiB.
    fn saved(owner: Option<&str>) -> SavedMachine {
        SavedMachine {
            owner: owner.map(str::to_owned),
            ..SavedMachine::new(Accelerator::Tcg, 1, 512)
        }
    }

    fn facts(
        warm: Option<&'static str>,
        saved: Option<SavedMachine>,
        disk_bytes: Option<u64>,
    ) -> StartFacts<'static, &'static str> {
        StartFacts {
            id: "sb",
            accelerator: Accelerator::Tcg,
            warm,
            saved,
            disk_bytes,
            wanted: wanted(),
        }
    }

    fn plan(cpus: u32, memory_mib: u64, grow: Option<u64>, identity: Option<bool>) -> Plan {
        Plan {
            cpus,
            memory_mib,
            grow_disk_to: grow,
            identity,
        }
    }

    #[test]
    fn a_warm_vm_taken_is_started_whatever_the_files_say() {
        for saved in [None, Some(saved(None))] {
            for disk in [None, Some(GIB), Some(9 * GIB)] {
                let decided = decide(facts(Some("warm-1"), saved.clone(), disk));
                assert_eq!(decided, Ok(VmStart::Warm("warm-1")));
            }
        }
    }

    #[test]
    fn without_a_warm_vm_or_saved_memory_it_boots_cold_at_its_own_size() {
        // An empty pool, or one whose machines fit another image or size,
        // gives `prepare` none: the start sees no warm VM.
        let decided = decide(facts(None, None, Some(3 * GIB)));
        assert_eq!(decided, Ok(VmStart::Cold(plan(2, 1024, None, Some(true)))));
        let smaller = decide(facts(None, None, Some(GIB)));
        assert_eq!(
            smaller,
            Ok(VmStart::Cold(plan(2, 1024, Some(3 * GIB), Some(true))))
        );
    }

    #[test]
    fn saved_memory_is_restored_at_the_size_it_was_saved_with() {
        let copy = decide(facts(None, Some(saved(None)), Some(3 * GIB)));
        assert_eq!(copy, Ok(VmStart::Restore(plan(1, 512, None, Some(false)))));
        let grown = decide(facts(None, Some(saved(None)), Some(GIB)));
        assert_eq!(
            grown,
            Ok(VmStart::Restore(plan(1, 512, Some(3 * GIB), Some(true))))
        );
    }

    #[test]
    fn its_own_paused_memory_needs_no_identity_unless_the_disk_grows() {
        let own = decide(facts(None, Some(saved(Some("sb"))), Some(3 * GIB)));
        assert_eq!(own, Ok(VmStart::Restore(plan(1, 512, None, None))));
        let another = decide(facts(None, Some(saved(Some("other"))), Some(3 * GIB)));
        assert_eq!(
            another,
            Ok(VmStart::Restore(plan(1, 512, None, Some(false))))
        );
        let grown = decide(facts(None, Some(saved(Some("sb"))), Some(GIB)));
        assert_eq!(
            grown,
            Ok(VmStart::Restore(plan(1, 512, Some(3 * GIB), Some(true))))
        );
    }

    #[test]
    fn memory_that_cannot_be_restored_here_is_refused() {
        let mut kvm = saved(None);
        kvm.accelerator = "kvm".to_owned();
        let refused = decide(facts(None, Some(kvm), Some(3 * GIB))).unwrap_err();
        assert!(matches!(&refused, Refusal::Incompatible(why) if why.contains("under kvm")));
        assert!(refused
            .reason()
            .starts_with("its saved memory cannot be restored"));
        let mut with_volumes = facts(None, Some(saved(None)), Some(3 * GIB));
        with_volumes.wanted.volumes = true;
        assert_eq!(decide(with_volumes), Err(Refusal::Volumes));
    }

    #[test]
    fn volumes_without_saved_memory_boot_cold() {
        let mut with_volumes = facts(None, None, Some(3 * GIB));
        with_volumes.wanted.volumes = true;
        assert!(matches!(decide(with_volumes), Ok(VmStart::Cold(_))));
    }

    #[test]
    fn saved_memory_whose_disk_is_gone_is_refused_not_restored() {
        assert_eq!(
            decide(facts(None, Some(saved(Some("sb"))), None)),
            Err(Refusal::NoDisk)
        );
        assert_eq!(decide(facts(None, None, None)), Err(Refusal::NoDisk));
    }

    #[test]
    fn a_disk_never_shrinks() {
        for saved in [None, Some(saved(None))] {
            let refused = decide(facts(None, saved, Some(4 * GIB))).unwrap_err();
            assert_eq!(
                refused,
                Refusal::Shrink {
                    current: 4 * GIB,
                    wanted: 3 * GIB
                }
            );
            assert!(refused.reason().contains("disks cannot shrink"));
        }
    }
}

//! Checks of user input that more than one part of the engine makes: names,
//! and the resources a sandbox asks for.

use crate::{Ceilings, EngineError};

/// Names are used in URLs and as host names: keep them plain.
pub(crate) fn check_name(name: &str) -> Result<(), EngineError> {
    check_word("name", name)
}

/// A name or tag in `field`: 1 to 63 letters, digits, `-`, `_` or `.`, so
/// it reads the same in a URL, a host name, a table and a log.
pub(crate) fn check_word(field: &'static str, word: &str) -> Result<(), EngineError> {
    let valid = !word.is_empty()
        && word.len() <= 63
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if valid {
        Ok(())
    } else {
        Err(EngineError::Invalid {
            field,
            reason: format!("{word:?} must be 1 to 63 letters, digits, '-', '_' or '.'"),
        })
    }
}

/// The vCPUs, memory (MiB) and disk (GiB) of a sandbox, from a request that
/// gives memory in GiB as Daytona's does; each defaults to `base`'s, is at
/// least 1 and within the ceilings.
pub(crate) fn sized(
    ceilings: Ceilings,
    (cpu, memory_gib, disk_gib): (Option<i64>, Option<i64>, Option<i64>),
    base: &cove_store::SnapshotRecord,
) -> Result<(i64, i64, i64), EngineError> {
    let memory_mib = match memory_gib {
        Some(gib) => resource("memory", Some(gib), 1, ceilings.memory_gib)? * 1024,
        // A snapshot may hold less than a GiB (a 256 MiB VM).
        None if base.memory_mib > ceilings.memory_gib * 1024 => {
            return Err(EngineError::AboveCeiling {
                field: "memory",
                requested: (base.memory_mib + 1023) / 1024,
                ceiling: ceilings.memory_gib,
            })
        }
        None => base.memory_mib.max(1),
    };
    Ok((
        resource("cpu", cpu, base.cpu.max(1), ceilings.cpu)?,
        memory_mib,
        resource("disk", disk_gib, base.disk_gib.max(1), ceilings.disk_gib)?,
    ))
}

fn resource(
    field: &'static str,
    requested: Option<i64>,
    default: i64,
    ceiling: i64,
) -> Result<i64, EngineError> {
    let value = requested.unwrap_or(default);
    if value < 1 {
        return Err(EngineError::Invalid {
            field,
            reason: format!("must be at least 1, got {value}"),
        });
    }
    if value > ceiling {
        return Err(EngineError::AboveCeiling {
            field,
            requested: value,
            ceiling,
        });
    }
    Ok(value)
}

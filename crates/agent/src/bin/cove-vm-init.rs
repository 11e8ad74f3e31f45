//! `/init` of a VM's initramfs: see `cove_agent::vm::initramfs`. On failure it
//! says why on the console and exits, which panics the kernel and so ends the
//! VM (`panic=-1` with QEMU's `-no-reboot`) instead of leaving it hanging.

fn main() {
    let failure = cove_agent::vm::initramfs::run();
    eprintln!("cove-vm-init: {failure}");
    std::process::exit(1);
}

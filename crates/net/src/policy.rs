//! A sandbox's egress policy and its checks: which CIDRs and names it may reach.
//! Pure data and matching; `nft` turns a checked policy into set elements and
//! `resolver` asks it which names to answer.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

/// At most this many entries in each list: each becomes a set element, and the
/// lists come from API clients.
pub(crate) const MAX_ENTRIES: usize = 1024;

/// What a sandbox may reach outside. The default lets everything out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// Nothing leaves the sandbox, and the resolver answers nothing.
    pub block_all: bool,
    /// If not empty, only these destinations (plus `allow_domains`) are reachable.
    pub allow_cidrs: Vec<Ipv4Net>,
    /// Never reachable, whatever the allow lists say (a cove extension).
    pub deny_cidrs: Vec<Ipv4Net>,
    /// If not empty, the resolver answers only these names (exact, or
    /// `*.suffix` for every name under `suffix`, not `suffix` itself), and the
    /// addresses it answers become reachable for the record's TTL.
    pub allow_domains: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("invalid CIDR {value:?}: {reason}")]
    InvalidCidr { value: String, reason: String },
    #[error("invalid domain {value:?}: {reason}")]
    InvalidDomain { value: String, reason: String },
    #[error("too many entries in {list}: {count}, at most {MAX_ENTRIES}")]
    TooMany { list: &'static str, count: usize },
}

impl Policy {
    /// Parses one CIDR as an API client writes it: `a.b.c.d/n`, or a bare
    /// address for `/32`. Host bits are masked, as Daytona's runner does when
    /// it applies `networkAllowList`: `192.168.1.0/16` is `192.168.0.0/16`
    /// (the prefix length is what decides the range).
    pub fn parse_cidr(text: &str) -> Result<Ipv4Net, PolicyError> {
        parse_unmasked(text).map(|net| net.trunc())
    }

    /// Parses one CIDR as [`Policy::parse_cidr`] does, but refuses host bits
    /// instead of masking them: for an operator's own settings, where
    /// `10.0.0.1/8` is more likely a typo than a range.
    pub fn parse_exact_cidr(text: &str) -> Result<Ipv4Net, PolicyError> {
        let net = parse_unmasked(text)?;
        if net.trunc() != net {
            return Err(PolicyError::InvalidCidr {
                value: text.to_owned(),
                reason: format!("host bits are set; the network is {}", net.trunc()),
            });
        }
        Ok(net)
    }

    /// Parses a comma-separated list of CIDRs (Daytona's `networkAllowList`);
    /// empty items are skipped.
    pub fn parse_cidr_list(text: &str) -> Result<Vec<Ipv4Net>, PolicyError> {
        text.split(',')
            .filter(|item| !item.trim().is_empty())
            .map(Self::parse_cidr)
            .collect()
    }

    /// Checks every domain and the list sizes; the error names the bad entry.
    pub fn validate(&self) -> Result<(), PolicyError> {
        for (list, count) in [
            ("allow_cidrs", self.allow_cidrs.len()),
            ("deny_cidrs", self.deny_cidrs.len()),
            ("allow_domains", self.allow_domains.len()),
        ] {
            if count > MAX_ENTRIES {
                return Err(PolicyError::TooMany { list, count });
            }
        }
        for net in self.allow_cidrs.iter().chain(&self.deny_cidrs) {
            if net.trunc() != *net {
                return Err(PolicyError::InvalidCidr {
                    value: net.to_string(),
                    reason: format!("host bits are set; the network is {}", net.trunc()),
                });
            }
        }
        for domain in &self.allow_domains {
            DomainPattern::parse(domain)?;
        }
        Ok(())
    }

    /// The checked policy in the forms the firewall and the resolver use.
    pub(crate) fn compile(&self) -> Result<CompiledPolicy, PolicyError> {
        self.validate()?;
        let domains = self
            .allow_domains
            .iter()
            .map(|d| DomainPattern::parse(d))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CompiledPolicy {
            block_all: self.block_all,
            // nftables interval sets refuse overlapping ranges, so overlaps merge.
            allow: Ipv4Net::aggregate(&self.allow_cidrs),
            deny: Ipv4Net::aggregate(&self.deny_cidrs),
            domains,
        })
    }
}

/// One CIDR (or a bare address, `/32`) as written, host bits kept.
fn parse_unmasked(text: &str) -> Result<Ipv4Net, PolicyError> {
    let value = text.trim();
    let invalid = |reason: &str| PolicyError::InvalidCidr {
        value: text.to_owned(),
        reason: reason.to_owned(),
    };
    if value.contains(':') {
        return Err(invalid("only IPv4 is supported"));
    }
    match value.parse::<Ipv4Net>() {
        Ok(net) => Ok(net),
        Err(_) => match value.parse::<Ipv4Addr>() {
            Ok(address) => Ok(Ipv4Net::from(address)),
            Err(_) => Err(invalid(
                "expected an IPv4 network a.b.c.d/n (n from 0 to 32), e.g. 192.168.1.0/24",
            )),
        },
    }
}

/// A policy ready to enforce: CIDRs merged, domains parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CompiledPolicy {
    pub block_all: bool,
    pub allow: Vec<Ipv4Net>,
    pub deny: Vec<Ipv4Net>,
    pub domains: Vec<DomainPattern>,
}

impl CompiledPolicy {
    /// Whether only listed destinations are reachable.
    pub(crate) fn restricted(&self) -> bool {
        !self.allow.is_empty() || !self.domains.is_empty()
    }

    /// What the resolver does with a query for `name`.
    pub(crate) fn resolve(&self, name: &str) -> Resolution {
        if self.block_all {
            return Resolution::Refuse;
        }
        if self.domains.is_empty() {
            return Resolution::Forward { admit: false };
        }
        let name = normalize(name);
        if self.domains.iter().any(|pattern| pattern.matches(&name)) {
            Resolution::Forward { admit: true }
        } else {
            Resolution::NotFound
        }
    }
}

/// The resolver's answer to a sandbox's query, by policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resolution {
    /// Ask upstream; with `admit`, the A records answered become reachable.
    Forward { admit: bool },
    /// Answer this address: the name is a linked sandbox's.
    Peer(Ipv4Addr),
    /// Answer NXDOMAIN without asking anyone: the name is not allowed.
    NotFound,
    /// Answer REFUSED: the sandbox may not resolve at all.
    Refuse,
}

/// `example.com` (that name only) or `*.example.com` (names under it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum DomainPattern {
    Exact(String),
    Suffix(String),
}

impl DomainPattern {
    pub(crate) fn parse(text: &str) -> Result<Self, PolicyError> {
        let invalid = |reason: &str| PolicyError::InvalidDomain {
            value: text.to_owned(),
            reason: reason.to_owned(),
        };
        let name = normalize(text.trim());
        let (wildcard, rest) = match name.strip_prefix("*.") {
            Some(rest) => (true, rest.to_owned()),
            None => (false, name),
        };
        if rest.is_empty() {
            return Err(invalid("empty name"));
        }
        if rest.len() > 253 {
            return Err(invalid("longer than 253 characters"));
        }
        for label in rest.split('.') {
            if label.is_empty() {
                return Err(invalid("empty label"));
            }
            if label.len() > 63 {
                return Err(invalid("a label is longer than 63 characters"));
            }
            if label.contains('*') {
                return Err(invalid(
                    "'*' may only be the whole first label, as in *.example.com",
                ));
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(invalid("labels may hold only letters, digits, '-' and '_'"));
            }
            if label.starts_with('-') || label.ends_with('-') {
                return Err(invalid("a label starts or ends with '-'"));
            }
        }
        Ok(if wildcard {
            Self::Suffix(rest)
        } else {
            Self::Exact(rest)
        })
    }

    /// `name` must already be normalized.
    pub(crate) fn matches(&self, name: &str) -> bool {
        match self {
            Self::Exact(exact) => name == exact,
            Self::Suffix(suffix) => name
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

/// Lower case, without the root's trailing dot.
fn normalize(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(text: &str) -> Ipv4Net {
        text.parse().unwrap()
    }

    #[test]
    fn cidrs_parse_with_bare_addresses_and_lists() {
        assert_eq!(Policy::parse_cidr("10.0.0.0/8").unwrap(), net("10.0.0.0/8"));
        assert_eq!(Policy::parse_cidr(" 1.2.3.4 ").unwrap(), net("1.2.3.4/32"));
        assert_eq!(
            Policy::parse_cidr_list("10.0.0.0/8, 192.168.1.0/24,").unwrap(),
            vec![net("10.0.0.0/8"), net("192.168.1.0/24")]
        );
    }

    #[test]
    fn host_bits_are_masked_as_daytonas_runner_does() {
        for (given, network) in [
            ("192.168.1.0/16", "192.168.0.0/16"),
            ("10.1.2.3/8", "10.0.0.0/8"),
            ("198.51.100.77/24", "198.51.100.0/24"),
            ("1.2.3.4/0", "0.0.0.0/0"),
            ("1.2.3.4/32", "1.2.3.4/32"),
        ] {
            assert_eq!(Policy::parse_cidr(given).unwrap(), net(network), "{given}");
        }
        assert_eq!(
            Policy::parse_cidr_list("192.168.1.0/16,10.9.9.9/8").unwrap(),
            vec![net("192.168.0.0/16"), net("10.0.0.0/8")]
        );
    }

    #[test]
    fn exact_cidrs_refuse_host_bits() {
        assert_eq!(
            Policy::parse_exact_cidr("10.0.0.0/8").unwrap(),
            net("10.0.0.0/8")
        );
        let err = Policy::parse_exact_cidr("10.0.0.1/8")
            .unwrap_err()
            .to_string();
        assert!(err.contains("10.0.0.1/8"), "{err}");
        assert!(err.contains("host bits"), "{err}");
        assert!(err.contains("10.0.0.0/8"), "{err}");
    }

    #[test]
    fn bad_cidrs_are_named() {
        for (bad, reason) in [
            ("10.0.0.0/33", "expected"),
            ("banana", "expected"),
            ("10.0.0.300/8", "expected"),
            ("10.0.0/8", "expected"),
            ("::1/128", "IPv4"),
        ] {
            for parse in [Policy::parse_cidr, Policy::parse_exact_cidr] {
                let err = parse(bad).unwrap_err();
                let message = err.to_string();
                assert!(message.contains(bad), "{message} should name {bad}");
                assert!(message.contains(reason), "{message} should say {reason}");
            }
        }
        let err = Policy::parse_cidr_list("10.0.0.0/8,300.1.1.1").unwrap_err();
        assert!(err.to_string().contains("300.1.1.1"), "{err}");
    }

    #[test]
    fn domains_validate_and_name_the_bad_one() {
        let good = Policy {
            allow_domains: vec![
                "Example.COM.".into(),
                "*.pypi.org".into(),
                "a_b.test".into(),
            ],
            ..Policy::default()
        };
        good.validate().unwrap();
        for bad in [
            "",
            "*",
            "a..b",
            "*.*.x",
            "exa*mple.com",
            "-a.com",
            "a b.com",
            "é.com",
        ] {
            let policy = Policy {
                allow_domains: vec!["ok.test".into(), bad.into()],
                ..Policy::default()
            };
            match policy.validate() {
                Err(PolicyError::InvalidDomain { value, .. }) => assert_eq!(value, bad),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
        let long = format!("{}.com", "a".repeat(64));
        assert!(DomainPattern::parse(&long).is_err());
    }

    #[test]
    fn patterns_match_exact_names_and_names_below_a_suffix() {
        let exact = DomainPattern::parse("allowed.test").unwrap();
        assert!(exact.matches("allowed.test"));
        assert!(!exact.matches("x.allowed.test"));
        assert!(!exact.matches("notallowed.test"));
        let suffix = DomainPattern::parse("*.example.com").unwrap();
        assert!(suffix.matches("a.example.com"));
        assert!(suffix.matches("b.a.example.com"));
        assert!(!suffix.matches("example.com"));
        assert!(!suffix.matches("badexample.com"));
        assert!(!suffix.matches(".example.com"));
    }

    #[test]
    fn resolution_follows_the_policy() {
        let compile = |policy: Policy| policy.compile().unwrap();
        let open = compile(Policy::default());
        assert!(!open.restricted());
        assert_eq!(
            open.resolve("any.test"),
            Resolution::Forward { admit: false }
        );

        let domains = compile(Policy {
            allow_domains: vec!["allowed.test".into()],
            ..Policy::default()
        });
        assert!(domains.restricted());
        assert_eq!(
            domains.resolve("ALLOWED.test."),
            Resolution::Forward { admit: true }
        );
        assert_eq!(domains.resolve("denied.test"), Resolution::NotFound);

        let blocked = compile(Policy {
            block_all: true,
            allow_domains: vec!["allowed.test".into()],
            ..Policy::default()
        });
        assert_eq!(blocked.resolve("allowed.test"), Resolution::Refuse);
    }

    #[test]
    fn overlapping_cidrs_merge() {
        let compiled = Policy {
            allow_cidrs: vec![net("10.0.0.0/8"), net("10.1.0.0/16"), net("192.168.0.0/24")],
            ..Policy::default()
        }
        .compile()
        .unwrap();
        assert_eq!(
            compiled.allow,
            vec![net("10.0.0.0/8"), net("192.168.0.0/24")]
        );
    }

    #[test]
    fn list_sizes_are_capped() {
        let policy = Policy {
            allow_domains: vec!["a.test".into(); MAX_ENTRIES + 1],
            ..Policy::default()
        };
        assert!(matches!(
            policy.validate(),
            Err(PolicyError::TooMany {
                list: "allow_domains",
                ..
            })
        ));
    }
}

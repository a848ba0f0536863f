//! What the agent reads in an X.509 certificate, and libpq's host-name rules.
//!
//! The certificate is parsed by `x509-cert` (RustCrypto: strict DER, X.509 v1 to v3, no
//! signature checked here; chains are webpki's job, see tls.rs). From it this module takes
//! what no crate answers in libpq's terms: the subjectAltName DNS names and IP addresses and
//! the subject's Common Names for libpq's host-name rules, the validity of a self-signed
//! certificate trusted as its own CA, whether it carries name constraints, the signature
//! algorithm for SCRAM channel binding (`tls-server-end-point`) and the SubjectPublicKeyInfo
//! to match a client key against.
//!
//! The host-name rules are libpq's (pgtls_verify_peer_name_matches_certificate_guts): SAN
//! entries of the host's kind first; the first Common Name only when there is none of that
//! kind (and, libpq's quirk, for an IP host with only DNS SANs); a wildcard only as the whole
//! first label; no embedded NUL; IP SANs of 4 or 16 bytes. One rule is the agent's own
//! (review L2): the Common Name is never consulted when the chain carries name constraints
//! or the roots are the system's, since webpki applies name constraints to SANs only and
//! public CAs issue no certificate without SANs.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use x509_cert::der::asn1::ObjectIdentifier;
use x509_cert::der::{Any, Decode, Encode, Tagged};
use x509_cert::Certificate;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AltName {
    Dns(Vec<u8>),
    Ip(Vec<u8>),
}

#[derive(Debug, Default)]
pub struct CertInfo {
    /// subjectAltName DNS names and IP addresses, in the certificate's order.
    pub alt_names: Vec<AltName>,
    /// The subject's Common Names, in order.
    pub common_names: Vec<Vec<u8>>,
    /// The validity period, UNIX seconds.
    pub not_before: i64,
    pub not_after: i64,
    /// The OID (content bytes) of the certificate's signature algorithm.
    pub signature_oid: Vec<u8>,
    /// The whole SubjectPublicKeyInfo element.
    pub public_key: Vec<u8>,
    /// Whether it has a nameConstraints extension.
    pub name_constraints: bool,
}

/// id-at-commonName, id-ce-subjectAltName, id-ce-nameConstraints.
const OID_CN: ObjectIdentifier = ObjectIdentifier::new_unwrap("2.5.4.3");
const OID_SAN: ObjectIdentifier = ObjectIdentifier::new_unwrap("2.5.29.17");
const OID_NAME_CONSTRAINTS: ObjectIdentifier = ObjectIdentifier::new_unwrap("2.5.29.30");

/// GeneralName's context tags: [2] dNSName, [7] iPAddress (implicit, primitive).
const TAG_DNS_NAME: u8 = 0x82;
const TAG_IP_ADDRESS: u8 = 0x87;

/// The certificate's fields, or None when it is not one certificate in strict DER (trailing
/// bytes included). x509-cert refuses BER's liberties but takes a DEFAULT value written out
/// (an extension's `critical FALSE`), so the certificate must also encode back to itself.
pub fn parse(der: &[u8]) -> Option<CertInfo> {
    let cert = Certificate::from_der(der).ok()?;
    if cert.to_der().ok()? != der {
        return None;
    }
    let tbs = &cert.tbs_certificate;
    let mut info = CertInfo {
        not_before: unix_seconds(tbs.validity.not_before.to_unix_duration()),
        not_after: unix_seconds(tbs.validity.not_after.to_unix_duration()),
        signature_oid: cert.signature_algorithm.oid.as_bytes().to_vec(),
        public_key: tbs.subject_public_key_info.to_der().ok()?,
        ..CertInfo::default()
    };
    for rdn in tbs.subject.0.iter() {
        for attribute in rdn.0.iter() {
            if attribute.oid == OID_CN {
                let tag = u8::from(attribute.value.tag());
                info.common_names
                    .push(decode_string(tag, attribute.value.value()));
            }
        }
    }
    for extension in tbs.extensions.iter().flatten() {
        if extension.extn_id == OID_SAN {
            info.alt_names = alt_names(extension.extn_value.as_bytes())?;
        } else if extension.extn_id == OID_NAME_CONSTRAINTS {
            info.name_constraints = true;
        }
    }
    Some(info)
}

/// Whether any of these certificates (DER) carries name constraints; one that does not
/// parse counts as carrying them (the safe side).
pub fn any_name_constraints<'a>(certs: impl IntoIterator<Item = &'a [u8]>) -> bool {
    certs
        .into_iter()
        .any(|der| parse(der).is_none_or(|info| info.name_constraints))
}

fn unix_seconds(since_epoch: std::time::Duration) -> i64 {
    i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX)
}

/// The DNS names and IP addresses of a subjectAltName value (GeneralNames, a SEQUENCE of
/// context-tagged names; the other kinds are skipped). Strict DER, or None.
fn alt_names(value: &[u8]) -> Option<Vec<AltName>> {
    let names = Vec::<Any>::from_der(value).ok()?;
    Some(
        names
            .iter()
            .filter_map(|name| match u8::from(name.tag()) {
                TAG_DNS_NAME => Some(AltName::Dns(name.value().to_vec())),
                TAG_IP_ADDRESS => Some(AltName::Ip(name.value().to_vec())),
                _ => None,
            })
            .collect(),
    )
}

/// A directory string's bytes: UTF-8, Printable, IA5 and T61 as they are, BMP (UTF-16BE)
/// converted.
fn decode_string(tag: u8, value: &[u8]) -> Vec<u8> {
    const BMP_STRING: u8 = 0x1e;
    if tag == BMP_STRING {
        let units: Vec<u16> = value
            .chunks(2)
            .map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))
            .collect();
        return String::from_utf16_lossy(&units).into_bytes();
    }
    value.to_vec()
}

/// The hash of `tls-server-end-point` for a signature algorithm (RFC 5929 section 4.1).
pub fn end_point_hash(oid: &[u8]) -> Option<&'static ring::digest::Algorithm> {
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    if let Some(rest) = oid.strip_prefix(RSA) {
        return match rest {
            [0x04] | [0x05] | [0x0b] => Some(&ring::digest::SHA256), // md5, sha1, sha256
            [0x0c] => Some(&ring::digest::SHA384),
            [0x0d] => Some(&ring::digest::SHA512),
            _ => None, // RSASSA-PSS (hash in parameters), SHA-224
        };
    }
    if oid == ECDSA_SHA1 {
        return Some(&ring::digest::SHA256);
    }
    if let Some(rest) = oid.strip_prefix(ECDSA_SHA2) {
        return match rest {
            [0x02] => Some(&ring::digest::SHA256),
            [0x03] => Some(&ring::digest::SHA384),
            [0x04] => Some(&ring::digest::SHA512),
            _ => None,
        };
    }
    None // Ed25519 and others: no hash, the server offers no channel binding either
}

/// Whether the subject's Common Name may stand for the host name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommonName {
    /// libpq's rule: when no SAN entry is of the host's kind.
    Fallback,
    /// Never: why not, for the message.
    Refused(&'static str),
}

/// libpq's wildcard rule: `*.` followed by the rest, the `*` matching one label.
fn wildcard_matches(pattern: &[u8], host: &[u8]) -> bool {
    if pattern.len() < 3 || pattern[0] != b'*' || pattern[1] != b'.' || pattern.len() > host.len() {
        return false;
    }
    let suffix = &pattern[1..];
    if !host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix) {
        return false;
    }
    let start = host.len() - pattern.len();
    !matches!(host.iter().position(|&c| c == b'.'), Some(i) if i < start)
}

fn name_matches(name: &[u8], host: &str) -> Result<bool, String> {
    if name.contains(&0) {
        return Err("server certificate's name contains an embedded null".to_string());
    }
    Ok(name.eq_ignore_ascii_case(host.as_bytes()) || wildcard_matches(name, host.as_bytes()))
}

fn ip_matches(ip: &[u8], host: &str) -> Result<(bool, String), String> {
    let shown = match <[u8; 4]>::try_from(ip) {
        Ok(v4) => Ipv4Addr::from(v4).to_string(),
        Err(_) => match <[u8; 16]>::try_from(ip) {
            Ok(v6) => Ipv6Addr::from(v6).to_string(),
            Err(_) => {
                return Err(format!(
                    "server certificate contains an IP address with invalid length {}",
                    ip.len()
                ))
            }
        },
    };
    let matched = match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => ip == a.octets(),
        Ok(IpAddr::V6(a)) => ip == a.octets(),
        Err(_) => false,
    };
    Ok((matched, shown))
}

/// libpq's host name check: SAN entries; the Common Name only when no SAN entry is of the
/// host's kind, and only if `common_name` allows it.
pub fn check_host_name(info: &CertInfo, host: &str, common_name: CommonName) -> Result<(), String> {
    let host_is_ip = host.parse::<IpAddr>().is_ok();
    let mut check_cn = true;
    let mut examined: Vec<String> = Vec::new();
    for name in &info.alt_names {
        let matched = match name {
            AltName::Dns(dns) => {
                if !host_is_ip {
                    check_cn = false;
                }
                examined.push(String::from_utf8_lossy(dns).into_owned());
                name_matches(dns, host)?
            }
            AltName::Ip(ip) => {
                if host_is_ip {
                    check_cn = false;
                }
                let (matched, shown) = ip_matches(ip, host)?;
                examined.push(shown);
                matched
            }
        };
        if matched {
            return Ok(());
        }
    }
    let mut refused = None;
    if check_cn {
        if let Some(cn) = info.common_names.first() {
            match common_name {
                CommonName::Fallback => {
                    examined.push(String::from_utf8_lossy(cn).into_owned());
                    if name_matches(cn, host)? {
                        return Ok(());
                    }
                }
                CommonName::Refused(why) => refused = Some(why),
            }
        }
    }
    let why_not_cn = refused
        .map(|why| format!("; its Common Name is not consulted: {why}"))
        .unwrap_or_default();
    if examined.is_empty() {
        return Err(format!(
            "could not get the server's host name from its certificate{why_not_cn}"
        ));
    }
    Err(format!(
        "host name \"{host}\" does not match the certificate (names: {}){why_not_cn}",
        examined.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;

    pub const CA_PEM: &str = include_str!("../testdata/tls/ca.crt");
    /// Signed by CA_PEM: CN=db1, subjectAltName DNS:db1, DNS:localhost, IP:127.0.0.1,
    /// ecdsa-with-SHA256, valid 2026-11-23T09:30:18Z to 2036-11-20T09:30:18Z.
    pub const SERVER_PEM: &str = include_str!("../testdata/tls/db1.crt");
    /// Self-signed, CN only (CN=*.example.com, no SAN), sha256WithRSAEncryption.
    pub const CN_ONLY_PEM: &str = include_str!("../testdata/tls/cn-only.crt");
    /// An intermediate with nameConstraints (permitted DNS:.example.com).
    const CONSTRAINED_CA_PEM: &str = include_str!("../testdata/tls/constrained-ca.crt");

    fn der(pem: &str) -> Vec<u8> {
        CertificateDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .as_ref()
            .to_vec()
    }

    #[test]
    fn parses_names_validity_and_signature() {
        let info = parse(&der(SERVER_PEM)).unwrap();
        assert_eq!(info.common_names, vec![b"db1".to_vec()]);
        assert_eq!(
            info.alt_names,
            vec![
                AltName::Dns(b"db1".to_vec()),
                AltName::Dns(b"localhost".to_vec()),
                AltName::Ip(vec![127, 0, 0, 1]),
            ]
        );
        assert_eq!((info.not_before, info.not_after), (1795426218, 2110786218));
        assert!(!info.name_constraints);
        assert!(std::ptr::eq(
            end_point_hash(&info.signature_oid).unwrap(),
            &ring::digest::SHA256
        ));
        let info = parse(&der(CN_ONLY_PEM)).unwrap();
        assert_eq!(info.common_names, vec![b"*.example.com".to_vec()]);
        assert!(info.alt_names.is_empty());
        assert!(std::ptr::eq(
            end_point_hash(&info.signature_oid).unwrap(),
            &ring::digest::SHA256
        ));
        assert!(parse(&der(CONSTRAINED_CA_PEM)).unwrap().name_constraints);
        assert!(any_name_constraints([der(CONSTRAINED_CA_PEM).as_slice()]));
        assert!(!any_name_constraints([der(CA_PEM).as_slice()]));
        assert!(any_name_constraints([&b"not a certificate"[..]]));
    }

    #[test]
    fn host_names_follow_libpq() {
        let check = |info: &CertInfo, host: &str| check_host_name(info, host, CommonName::Fallback);
        let info = parse(&der(SERVER_PEM)).unwrap();
        assert!(check(&info, "db1").is_ok());
        assert!(check(&info, "DB1").is_ok(), "case-insensitive");
        assert!(check(&info, "localhost").is_ok());
        assert!(check(&info, "127.0.0.1").is_ok());
        let e = check(&info, "db9").unwrap_err();
        assert_eq!(
            e,
            "host name \"db9\" does not match the certificate (names: db1, localhost, 127.0.0.1)"
        );
        assert!(check(&info, "127.0.0.2").is_err());
        // The CN is not consulted when a DNS SAN exists (db1 is in both here; see below).
        let info = CertInfo {
            alt_names: vec![AltName::Dns(b"a".to_vec())],
            common_names: vec![b"b".to_vec()],
            ..CertInfo::default()
        };
        assert!(check(&info, "b").is_err());
        // For an IP host, the CN counts when no IP SAN exists, even with DNS SANs (libpq).
        let info = CertInfo {
            alt_names: vec![AltName::Dns(b"a".to_vec())],
            common_names: vec![b"10.0.0.1".to_vec()],
            ..CertInfo::default()
        };
        assert!(check(&info, "10.0.0.1").is_ok());
        // Wildcards: one label, first position, case-insensitive.
        let info = parse(&der(CN_ONLY_PEM)).unwrap();
        assert!(check(&info, "db.example.com").is_ok());
        assert!(check(&info, "DB.Example.COM").is_ok());
        assert!(check(&info, "a.b.example.com").is_err());
        assert!(check(&info, "example.com").is_err());
        let e = check(&info, "db.example.org").unwrap_err();
        assert!(e.contains("names: *.example.com"), "{e}");
        // Nothing to match against.
        assert!(check(&CertInfo::default(), "x")
            .unwrap_err()
            .contains("could not get"));
        // Embedded NUL (CVE-2009-4034), and IP SANs of a wrong length.
        let info = CertInfo {
            alt_names: vec![AltName::Dns(b"db1\0.evil".to_vec())],
            ..CertInfo::default()
        };
        assert!(check(&info, "db1").unwrap_err().contains("embedded null"));
        let info = CertInfo {
            alt_names: vec![AltName::Ip(vec![127, 0, 0])],
            ..CertInfo::default()
        };
        assert!(check(&info, "127.0.0.1")
            .unwrap_err()
            .contains("invalid length 3"));
    }

    #[test]
    fn the_common_name_is_refused_under_name_constraints() {
        let info = parse(&der(CN_ONLY_PEM)).unwrap();
        let e = check_host_name(
            &info,
            "db.example.com",
            CommonName::Refused("the chain carries name constraints"),
        )
        .unwrap_err();
        assert_eq!(
            e,
            "could not get the server's host name from its certificate; its Common Name is \
             not consulted: the chain carries name constraints"
        );
        // SANs still count.
        let info = parse(&der(SERVER_PEM)).unwrap();
        assert!(check_host_name(&info, "db1", CommonName::Refused("x")).is_ok());
    }

    /// The parser on hostile input: every prefix and every single-byte change of the test
    /// certificates. Nothing panics; no proper prefix parses (no trailing-garbage or
    /// truncation leniency); whatever still parses after a change is canonical DER (it
    /// encodes back to the same bytes), so no two encodings of one certificate are read.
    /// (Before `parse` re-encoded, this found x509-cert accepting `critical FALSE` written
    /// out: byte 295 of ca.crt, 0xff ^ 0xff.)
    #[test]
    fn hostile_input_is_refused_without_panicking() {
        for pem in [CA_PEM, SERVER_PEM, CN_ONLY_PEM, CONSTRAINED_CA_PEM] {
            let good = der(pem);
            for len in 0..good.len() {
                assert!(
                    parse(&good[..len]).is_none(),
                    "prefix of {len} bytes parsed"
                );
            }
            let mut longer = good.clone();
            longer.push(0);
            assert!(parse(&longer).is_none(), "trailing byte accepted");
            for i in 0..good.len() {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut bad = good.clone();
                    bad[i] ^= flip;
                    if parse(&bad).is_some() {
                        let reencoded = Certificate::from_der(&bad).unwrap().to_der().unwrap();
                        assert_eq!(reencoded, bad, "byte {i} ^ {flip:#x}: not canonical DER");
                    }
                }
            }
        }
    }

    #[test]
    fn a_default_value_written_out_is_refused() {
        // ca.crt's basicConstraints is critical (01 01 ff); critical FALSE must be left out.
        let good = der(CA_PEM);
        let at = good
            .windows(3)
            .position(|w| w == [0x01, 0x01, 0xff])
            .unwrap();
        let mut bad = good.clone();
        bad[at + 2] = 0x00;
        assert!(
            Certificate::from_der(&bad).is_ok(),
            "x509-cert alone takes it"
        );
        assert!(parse(&bad).is_none());
    }

    #[test]
    fn non_minimal_lengths_are_refused() {
        // The outer SEQUENCE's length 0x82 HH LL written as 0x83 00 HH LL: valid BER, not DER.
        let good = der(SERVER_PEM);
        assert_eq!(good[1], 0x82);
        let mut bad = vec![0x30, 0x83, 0x00];
        bad.extend_from_slice(&good[2..]);
        assert!(parse(&good).is_some());
        assert!(parse(&bad).is_none());
    }

    #[test]
    fn bmp_strings_are_converted() {
        assert_eq!(decode_string(0x1e, &[0, b'd', 0, b'b']), b"db".to_vec());
        assert_eq!(decode_string(0x0c, b"db"), b"db".to_vec());
        assert_eq!(decode_string(0x1e, &[0]).len(), 1, "odd length: no panic");
    }
}

#!/usr/bin/env bash
# Certificates for a development stack's mutual TLS (common/tls.py): one internal CA and one
# certificate per role that every role presents to the others and accepts from them.
#   usage: make-dev-certs.sh OUT_DIR [EXTRA_SAN ...]     e.g. DNS:decode  IP:10.0.0.5
# Writes OUT_DIR/{ca.pem, ca.key, gateway.pem/.key, prefill.pem/.key, decode.pem/.key}.
# Every certificate names 127.0.0.1, localhost and pdserve.internal (for --tls-server-name
# where node addresses are pod IPs), plus the EXTRA_SANs. Keys are EC P-256, valid 30 days:
# for development stacks (compose's one-off job runs this), not a production PKI.
set -euo pipefail
OUT=${1:?usage: make-dev-certs.sh OUT_DIR [EXTRA_SAN ...]}
shift
mkdir -p "$OUT"
cd "$OUT"
umask 077
SANS="IP:127.0.0.1,DNS:localhost,DNS:pdserve.internal"
for san in "$@"; do SANS="$SANS,$san"; done
if [ ! -s ca.pem ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
    -subj "/CN=pdserve dev CA" -keyout ca.key -out ca.pem 2>/dev/null
fi
for role in gateway prefill decode; do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=pdserve-$role" -keyout "$role.key" -out "$role.csr" 2>/dev/null
  openssl x509 -req -in "$role.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$SANS") \
    -out "$role.pem" 2>/dev/null
  rm -f "$role.csr"
done
chmod 644 ca.pem gateway.pem prefill.pem decode.pem
chmod 640 ca.key gateway.key prefill.key decode.key
echo "certificates in $(pwd): ca.pem, {gateway,prefill,decode}.{pem,key}"

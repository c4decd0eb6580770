#!/usr/bin/env sh
# Waits while another program (apt-get, unattended-upgrades, another bootstrap) holds apt's or dpkg's
# lock, so that scripts/bootstrap.sh's apt-get waits its turn on a shared machine instead of failing
# (apt-get exits 100 on a held lock). One line says who holds it, then one at least every 30 s.
#   scripts/wait-for-dpkg-lock.sh [LOCK_FILE...]   (default: dpkg's and apt's lock files)
# The locks are fcntl locks, which /proc/locks lists with the holder's process id and the file's inode.
set -eu
[ "$#" -gt 0 ] || set -- /var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock \
  /var/cache/apt/archives/lock

# "PID (NAME) on FILE" for the first of the lock files someone holds, or nothing.
holder() {
  for file in "$@"; do
    [ -e "$file" ] || continue
    inode=$(stat -c %i "$file")
    # /proc/locks: "1: POSIX  ADVISORY  WRITE 1234 fe:00:402117 0 EOF"; a waiter's line has "->" in it
    pid=$(awk -v inode="$inode" '$2 != "->" && split($6, dev, ":") == 3 && dev[3] == inode { print $5; exit }' \
          /proc/locks 2>/dev/null)
    if [ -n "$pid" ]; then
      echo "process $pid ($(cat "/proc/$pid/comm" 2>/dev/null || echo gone)) on $file"
      return 0
    fi
  done
}

held=$(holder "$@")
[ -n "$held" ] || exit 0
echo "bootstrap: waiting for the package lock, held by $held" >&2
began=$(date +%s)
next=$((began + 30))
while held=$(holder "$@"); [ -n "$held" ]; do
  sleep 1
  now=$(date +%s)
  if [ "$now" -ge "$next" ]; then
    echo "bootstrap: still waiting for the package lock ($((now - began)) s), held by $held" >&2
    next=$((now + 30))
  fi
done
echo "bootstrap: the package lock is free after $(($(date +%s) - began)) s" >&2

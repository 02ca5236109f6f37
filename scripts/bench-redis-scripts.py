#!/usr/bin/env python3
"""idem-redis's begin and complete scripts of two versions on a private redis-server (a free
loopback port, no persistence, killed at the end): Redis commands per first call and per replay,
and the server's time per EVALSHA (INFO commandstats), 2000 records each, one at a time.

    git show <rev>:crates/idem-redis/src/scripts.rs > /tmp/old_scripts.rs
    python3 scripts/bench-redis-scripts.py /tmp/old_scripts.rs crates/idem-redis/src/scripts.rs

Needs redis-server on PATH and redis-py (the Powertools virtualenv of bench-http-payments has it).
The earlier layout takes three keys (record, lease, fence), the one-key layout's complete one.
"""
import re, sys, subprocess, time, socket, os, hashlib
import redis

def scripts(path):
    src = open(path).read()
    prelude = ''
    m = re.search(r'const PRELUDE: &str = r"(.*?)";', src, re.S)
    if m: prelude = m.group(1)
    out = {}
    for name in ['BEGIN', 'COMPLETE']:
        m = re.search(r'pub\(crate\) static ' + name + r': LazyLock<Script> = LazyLock::new\(\|\| \{\s*(?:Script::new|script)\(\s*r"(.*?)",\s*\)', src, re.S)
        out[name] = (prelude if 'script(' in m.group(0) else '') + m.group(1)
    return out

s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()
p = subprocess.Popen(['redis-server', '--port', str(port), '--save', '', '--appendonly', 'no'], stdout=subprocess.DEVNULL)
time.sleep(0.5)
try:
    r = redis.Redis(port=port)
    fp = hashlib.sha256(b'x').digest()
    for label, path in [('before', sys.argv[1]), ('after', sys.argv[2])]:
        sc = scripts(path)
        b = r.register_script(sc['BEGIN']); c = r.register_script(sc['COMPLETE'])
        N = 2000
        def keys(i):
            base = f'{label}:{{k{i}}}:'
            return [base + 'rec', base + 'lease', base + 'fence']
        b(keys=keys(-1), args=[fp, 30000, 600000]); 
        r.config_resetstat()
        for i in range(N):
            res = b(keys=keys(i), args=[fp, 30000, 600000])
            fence = res[1]
            ks = keys(i) if 'redis.call(\'HMGET\'' in sc['COMPLETE'] else keys(i)[:1]
            c(keys=ks, args=[fence, b'{"ok":1}', 600000])
        st1 = r.info('commandstats')
        r.config_resetstat()
        for i in range(N):
            b(keys=keys(i), args=[fp, 30000, 600000])
        st2 = r.info('commandstats')
        def show(st):
            mix = {k[8:]: v['calls'] / N for k, v in st.items() if k not in ('cmdstat_info', 'cmdstat_config')}
            ev = st.get('cmdstat_evalsha', {})
            return f"{sum(mix.values()):.1f} commands {mix}; EVALSHA usec_per_call {ev.get('usec_per_call')} (usec total per op {st['cmdstat_evalsha']['usec'] / N:.1f})"
        print(f'{label} first call: {show(st1)}')
        print(f'{label} replay:     {show(st2)}')
finally:
    p.kill()

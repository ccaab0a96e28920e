"""The two code texts the session-50 head probe calibrated on, from this machine's Python 3.11
standard library (never the evaluation set: lines the evaluation texts also hold are dropped).

cal_email.txt: the first 16 lines of every email/*.py module, each after a `# file:` header, so
one 1,024-token window holds several copies of the package's licence header (far copies, as in
the evaluation's code text). cal_json.txt: the first 120 lines of every json/*.py module.
"""
import glob
import os
import email
import json

evaluation = set()
for name in ["code", "dialogue", "wiki"]:
    path = os.path.expanduser(f"~/.cache/turbokv/data/eval/{name}.txt")
    evaluation |= {l.strip() for l in open(path).read().splitlines()}


def build(package, lines, out):
    parts = []
    for f in sorted(glob.glob(os.path.dirname(package.__file__) + "/*.py")):
        head = open(f).read().splitlines()[:lines]
        parts.append(f"# file: {package.__name__}/{os.path.basename(f)}\n" + "\n".join(head) + "\n\n")
    keep = [l for l in "".join(parts).splitlines()
            if not (len(l.strip()) > 12 and l.strip() in evaluation)]
    open(out, "w").write("\n".join(keep) + "\n")


build(email, 16, "/tmp/cal_email.txt")
build(json, 120, "/tmp/cal_json.txt")

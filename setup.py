"""Maps the top-level folders into the `swarm_node` import namespace.

`node/`, `protocol/`, `verifier/` and `cli/` are generic names that would clash with other
installed distributions, so they install as `swarm_node.node`, `swarm_node.protocol`, ...
(`swarm_node` itself is an implicit namespace package). Works for editable installs too.
"""

from setuptools import find_packages, setup

FOLDERS = ("node", "protocol", "verifier", "cli")

package_dir = {}
packages = []
for folder in FOLDERS:
    name = f"swarm_node.{folder}"
    package_dir[name] = folder
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

# The dashboard page is data, not code.
setup(packages=packages, package_dir=package_dir,
      package_data={"swarm_node.node.dashboard": ["*.html"]})

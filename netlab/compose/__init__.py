"""The compose lab: pddlink's roles in containers, netlab's relay in a container as their WAN.

``images`` builds the images locally (a Debian minbase from debootstrap, the package and its pinned
wheels on it), ``engine`` runs the container engine (the machine's dockerd, or one of the lab's own
that it stops again, restoring the host's firewall and sysctls: ``hostnet``), ``lab`` manages one lab
(docker networks for dc-a and dc-b, the relay container between them, the role containers) and
``relay`` is what runs inside the relay container. The CLI is ``pddlink lab compose``.
"""

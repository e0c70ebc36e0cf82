"""The guard's pure parts (snapshot.py, seccomp.py): when it is refused, what it makes the
thread run. The guard itself is tested live in tests/integration/test_tracer_death.py."""
from memunreachable.collect import seccomp as sc
from memunreachable.collect.sites import RESTORE_RT, SYSCALL_RET, shadow_stack_in

STATUS = (b"Name:\tprog\nState:\tS (sleeping)\nSeccomp:\t0\n"
          b"x86_Thread_features:\t%s\nx86_Thread_features_locked:\tshstk wrss\n")


def test_a_shadow_stack_refuses_the_guard():
    assert shadow_stack_in(STATUS % b"shstk wrss")
    assert shadow_stack_in(STATUS % b"wrss shstk")
    assert not shadow_stack_in(STATUS % b"")                 # locked but not enabled
    assert not shadow_stack_in(STATUS % b"wrss")
    assert not shadow_stack_in(b"Name:\tprog\nSeccomp:\t0\n")  # a kernel before 6.6


def test_the_gadgets_are_the_instructions_the_frames_need():
    assert SYSCALL_RET == bytes([0x0F, 0x05, 0xC3])                          # syscall; ret
    assert RESTORE_RT == bytes([0x48, 0xC7, 0xC0, 15, 0, 0, 0, 0x0F, 0x05])  # mov $15,%rax; syscall


def test_guarded_calls_add_what_the_frames_run():
    plain = sc.injected_calls(0x5000)
    guarded = sc.injected_calls(0x5000, restore_rt=0x9000)
    assert guarded[:len(plain)] == plain
    extra = guarded[len(plain):]
    assert [(c.name, c.nr, c.ip) for c in extra] == [("rt_sigreturn", 15, 0x9009),
                                                    ("exit_group", 231, 0x5002)]
    assert all(c.args == (0, 0, 0, 0, 0, 0) for c in extra)


def test_reap_calls_are_the_wait4_and_with_a_guard_its_frames_calls():
    assert [(c.name, c.args[0]) for c in sc.reap_calls(0x5000, 77)] == [("wait4", 77)]
    assert [(c.name, c.ip) for c in sc.reap_calls(0x5000, 77, restore_rt=0x9000)] == \
        [("wait4", 0x5002), ("rt_sigreturn", 0x9009), ("exit_group", 0x5002)]
